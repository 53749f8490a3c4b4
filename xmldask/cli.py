"""The ``xmldask`` command line: ``ingest``, ``synth``, ``info``, ``spectrum``, ``train``, ``predict``,
``evaluate``, ``demo``, ``tree``, ``tree-info`` and ``mask``.

Run ``xmldask COMMAND --help`` for the options of each command.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import sys
import time

from . import __version__
from .io.parse import ParseError
from .progress import progress_to
from .store import StoreError, format_info

logger = logging.getLogger("xmldask")


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _add_out(p, what: str, metavar: str = "URL", *, overwrite: bool = True, progress: bool = False) -> None:
    """``--out`` (required), ``--overwrite`` and ``--no-progress`` of a command that writes ``what``."""
    p.add_argument("--out", required=True, metavar=metavar, help=f"{what} to write (path or fsspec URL)")
    if overwrite:
        p.add_argument("--overwrite", action="store_true", help=f"replace an existing {what} at --out")
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_seed(p, of: str = "of the random draws") -> None:
    """``--seed S`` (default 0): the same seed gives the same result."""
    p.add_argument("--seed", type=int, default=0, metavar="S", help=f"seed {of} (default 0)")


def _print(args, result: dict, text) -> int:
    """Print ``result`` as JSON (``--json``) or as ``text(result)``; the command's exit status 0."""
    print(json.dumps(result, indent=2, default=float) if args.json else text(result))
    return 0


def _print_dataset(ds, start: float) -> int:
    """Print where the dataset store ``ds`` was written, in how long since ``start``, and its summary."""
    print(f"wrote {ds.url} in {time.perf_counter() - start:.1f} s")
    print(format_info(ds.info()))
    return 0


def _add_json(p, keys: str | None = None) -> None:
    """``--json``: print the command's result as JSON instead of text."""
    p.add_argument("--json", action="store_true", help=f"print JSON (keys include {keys})" if keys else
                   "print the result as JSON")


def _add_ingest(p) -> None:
    from .store.layout import BLOCK_ROWS

    p.add_argument("sources", nargs="+", metavar="SOURCE", help="text file path or fsspec URL")
    _add_out(p, "dataset store", overwrite=False)
    p.add_argument("--format", default="auto", choices=["auto", "xc", "libsvm", "vw"],
                   help="input format (default: guessed from each file's name and first line)")
    p.add_argument("--one-based", action="store_true", help="feature and label ids in the files start at 1")
    p.add_argument("--block-rows", type=_positive, default=BLOCK_ROWS, metavar="N",
                   help=f"rows per row block in the store (default {BLOCK_ROWS})")
    p.add_argument("--normalize", default="none", choices=["none", "l2", "l1", "sqrt"],
                   help="row transform: unit L2 or L1 norm, or sqrt = the Hellinger map (default none)")
    p.add_argument("--bias", type=float, default=None, metavar="VALUE",
                   help="append a constant bias feature with this value as the last column")
    p.add_argument("--n-features", type=_positive, default=None, metavar="D",
                   help="number of features (default: the XC header, else the largest id + 1)")
    p.add_argument("--n-labels", type=_positive, default=None, metavar="L",
                   help="number of labels (default: the XC header, else the largest id + 1)")
    p.add_argument("--duplicates", default="error", choices=["error", "sum"],
                   help="a feature id repeated within a row is an error (default) or its values are summed")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--overwrite", action="store_true", help="replace an existing store at --out")
    mode.add_argument("--append", action="store_true", help="add the rows to the existing dataset at --out")
    p.add_argument("--skip-ingested", action="store_true",
                   help="with --append: skip files the dataset already holds (same sha256)")
    p.add_argument("--observed", nargs="+", default=None, metavar="FILE",
                   help="missing labels: one file per SOURCE whose line i lists the comma-separated label ids "
                        "known (relevant or not) for row i; every other entry is unknown (default: all known)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _cmd_ingest(args) -> int:
    """Read text files (XC, LIBSVM, Vowpal Wabbit; gzip or plain) into a dataset store.

    Stream one or more text files into a dataset store of CSR row blocks. Several SOURCE files are concatenated
    row-wise. Memory stays bounded whatever the file size. On bad input the error names the file, the line and its
    text, and no store is left behind.
    """
    from .io import ingest

    start = time.perf_counter()
    ds = ingest(args.sources, args.out, format=args.format, one_based=args.one_based, block_rows=args.block_rows,
                normalize=args.normalize, bias=args.bias, n_features=args.n_features, n_labels=args.n_labels,
                duplicates=args.duplicates, overwrite=args.overwrite, append=args.append,
                skip_ingested=args.skip_ingested, observed=args.observed, progress=not args.no_progress)
    return _print_dataset(ds, start)


def _add_synth(p) -> None:
    from .store.layout import BLOCK_ROWS
    from .xmc import PRESETS

    _add_out(p, "dataset store", progress=True)
    p.add_argument("--preset", choices=list(PRESETS), default=None,
                   help="the label-first XMC generator (xmldask.xmc) with the published sizes of a repository dataset "
                        "(eurlex-4k, ..., amazon-670k) or a 10K / 100K / 1M-label text-like set; --split train or "
                        "test picks its row count; --n-samples, --n-features, --n-labels, --avg-features and "
                        "--avg-labels override it")
    p.add_argument("--n-samples", type=_positive, default=None, metavar="N", help="rows (required without --preset)")
    p.add_argument("--n-features", type=_positive, default=None, metavar="D",
                   help="feature columns (required without --preset)")
    p.add_argument("--n-labels", type=_positive, default=None, metavar="L",
                   help="label columns (required without --preset)")
    p.add_argument("--multiclass", action="store_true", help="exactly one label per row")
    _add_seed(p)
    p.add_argument("--split", default="train", help="rows to draw from the model: train (default), test, ...")
    p.add_argument("--rank", type=_positive, default=None,
                   help="number of planted topics (default: 32, or fewer with fewer labels or features)")
    p.add_argument("--avg-features", type=float, default=None,
                   help="mean feature draws per row; repeats add up, so nonzeros are a little fewer (default 20; "
                        "with --preset the preset's features a row)")
    p.add_argument("--avg-labels", type=float, default=None,
                   help="mean label draws per row, multilabel; repeats merge (default 3; with --preset the preset's)")
    p.add_argument("--block-rows", type=_positive, default=BLOCK_ROWS, metavar="N", help="rows of a store block")
    p.add_argument("--normalize", default="none", choices=["none", "l2", "l1", "sqrt"],
                   help="row normalisation of the features (without --preset; a preset's rows are unit L2 "
                        "log-counts)")


def _cmd_synth(args) -> int:
    """Generate a synthetic XMC dataset (power-law labels, planted low-rank structure).

    Generate a realistic synthetic extreme-classification dataset straight into a store, block by block (any size
    fits in bounded memory). The same --seed gives the same data; --split test draws other rows from the same
    planted model, for a held-out set.
    """
    from .datasets import make_synthetic

    start = time.perf_counter()
    sizes = {name: getattr(args, name) for name in ("n_samples", "n_features", "n_labels", "avg_features",
                                                    "avg_labels") if getattr(args, name) is not None}
    if args.preset:
        from .xmc import make_xmc, preset

        for name, given in (("--multiclass", args.multiclass), ("--rank", args.rank is not None),
                            ("--normalize", args.normalize != "none")):
            if given:
                raise ValueError(f"{name} does not apply with --preset (the label-first generator)")
        ds = make_xmc(args.out, **preset(args.preset, args.split, **sizes), seed=args.seed,
                      block_rows=args.block_rows, overwrite=args.overwrite, progress=not args.no_progress)
        return _print_dataset(ds, start)
    missing = [f"--{name.replace('_', '-')}" for name in ("n_samples", "n_features", "n_labels") if name not in sizes]
    if missing:
        raise ValueError(f"{', '.join(missing)} required (or --preset NAME)")
    ds = make_synthetic(args.out, multiclass=args.multiclass, seed=args.seed, split=args.split, rank=args.rank,
                        **{"avg_features": 20.0, "avg_labels": 3.0, **sizes}, block_rows=args.block_rows,
                        normalize=args.normalize, overwrite=args.overwrite, progress=not args.no_progress)
    return _print_dataset(ds, start)


def _add_info(p) -> None:
    p.add_argument("url", metavar="URL", help="dataset store (xmldask ingest --out)")
    _add_json(p, "n_samples, n_features, n_labels, nnz")


def _cmd_info(args) -> int:
    """Summarise a dataset store.

    Print the size, density and label-frequency profile of a dataset store.
    """
    from .store import open_dataset

    info = open_dataset(args.url).info()
    return _print(args, info, format_info)


def _add_spectrum(p) -> None:
    p.add_argument("url", metavar="DATA_URL", help="dataset store")
    p.add_argument("--matrix", default="Y", choices=["Y", "X"], help="Y (labels, default) or X (features)")
    from .embedding.spectrum import SPECTRUM_COMPONENTS

    p.add_argument("--n-components", "--k", dest="n_components", type=_positive, default=SPECTRUM_COMPONENTS,
                   metavar="N", help=f"eigenvalues to estimate (default {SPECTRUM_COMPONENTS})")
    p.add_argument("--oversample", type=int, default=20, help="oversampling p (default 20)")
    p.add_argument("--n-iter", type=int, default=1, help="power iterations q (default 1: two passes)")
    p.add_argument("--center", action="store_true", help="centre the columns first (covariance)")
    p.add_argument("--random-state", "--seed", dest="random_state", type=int, default=0, metavar="S",
                   help="seed of the random draws (default 0)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for spectrum.csv, .md and .png")
    p.add_argument("--no-plot", action="store_true", help="do not write spectrum.png")
    p.add_argument("--overwrite", action="store_true", help="replace spectrum.csv, .md and .png already in --out")


def _cmd_spectrum(args) -> int:
    """Estimate the spectrum of the label covariance Y^T Y (or of X^T X) by randomized PCA.

    Estimate the top eigenvalues of Y^T Y (the empirical label covariance) or X^T X of a dataset store with
    randomized PCA (Algorithm 1 of the Rembrandt paper: n-iter + 1 passes over the data), as in the paper's Figure
    1b. Writes spectrum.csv and spectrum.md (rank, eigenvalue, share of the trace) and spectrum.png (log-scale plot)
    into --out.
    """
    from .embedding.spectrum import compute_spectrum, write_spectrum

    spectrum = compute_spectrum(args.url, matrix=args.matrix, n_components=args.n_components,
                                oversample=args.oversample, n_iter=args.n_iter, center=args.center,
                                random_state=args.random_state)
    paths = write_spectrum(spectrum, args.out, plot=not args.no_plot, overwrite=args.overwrite)
    top = ", ".join(f"{v:.4g}" for v in spectrum.eigenvalues[:5])
    print(f"{spectrum.matrix}: top eigenvalues {top} ... ({len(spectrum.eigenvalues)} in all, "
          f"{spectrum.n_passes} passes, {spectrum.seconds:.1f} s)")
    for path in paths.values():
        print(f"wrote {path}")
    return 0


def _refuse_target_early(out: str, kind: str, overwrite: bool, inputs: list) -> None:
    """The output checks of the job (:func:`xmldask.store.check_target`), before a cluster starts: an existing
    ``--out`` is refused in a moment, not after the cluster's start-up."""
    from .store import check_target

    check_target(out, kind=kind, overwrite=overwrite, inputs=[i for i in inputs if i])


@contextlib.contextmanager
def _cluster_context(args, data_url: str):
    """The Dask cluster of a command on the dataset store ``data_url`` (``--scheduler`` /
    ``$XMLDASK_SCHEDULER``, or a local cluster: threads of this process for small data); prints the
    dashboard link."""
    from .cluster import cluster_from_args
    from .store import open_dataset

    with cluster_from_args(args, data_bytes=open_dataset(data_url).nbytes) as client:
        if client.dashboard_link:
            print(f"Dask dashboard: {client.dashboard_link}", file=sys.stderr)
        yield client


def _add_fitting(p, params, title: str, *, out: tuple[str, str], keys: str) -> None:
    """The options of a command that fits on ``TRAIN_URL``, generated from ``params`` (a parameters model),
    and writes a model store at ``--out``."""
    from .cluster import add_cluster_arguments
    from .params import add_arguments

    p.add_argument("train_url", metavar="TRAIN_URL", help="training dataset store")
    _add_out(p, *out)
    _add_json(p, keys)
    add_arguments(p, params, title=title)
    add_cluster_arguments(p)


def _add_train(p) -> None:
    from .models import TrainParams

    _add_fitting(p, TrainParams, "training parameters", out=("model store", "MODEL_URL"),
                 keys="model, seconds, params, held_out")


def _cmd_train(args) -> int:
    """Fit a classifier on a dataset store and save it (by default chosen by the number of labels, its parameters
    chosen on held-out training rows).

    Fit a model on a dataset store and write a model store. By default (--model auto) a dataset of more than about
    2,000 labels gets the label-centroid tree, which scores only the labels of a row's best label clusters (the beam
    chosen on held-out training rows); a smaller one the label-embedding classifier, which embeds the labels
    (rembrandt, cs, plst) or the features (pca), regresses onto the embedding, optionally maps through random Fourier
    features, and fits a softmax/logistic decoder early-stopped on a held-out slice of the training rows. --model
    chooses either, LEML, binary relevance or multiclass boosting; --tree a spectral label tree's
    candidate-restricted classifier.
    """
    from . import jobs
    from .models import TrainParams
    from .params import from_args

    params = from_args(args, TrainParams)
    jobs.check_search(params)
    _refuse_target_early(args.out, "model", args.overwrite, [args.train_url, params.get("tree")])
    with _cluster_context(args, args.train_url):
        info = jobs.train(args.train_url, args.out, overwrite=args.overwrite, **params)
    return _print(args, info, _train_text)


def _train_text(info: dict) -> str:
    """The summary of a trained model (the search's candidates were shown as they finished)."""
    def figures(name):
        return ", ".join(f"{key} {value:.4g}" for key, value in info.get(name, {}).items() if isinstance(value, float))

    held, training = figures("held_out"), figures("training")
    chosen = f"chose {info['params']}; " if "search" in info else ""
    clusters = f", {info['n_clusters']:,} label clusters" if "n_clusters" in info else ""
    members = info.get("n_estimators", info.get("params", {}).get("n_estimators", 1))
    clusters += f", an ensemble of {members}" if members > 1 else ""
    backoffs = f", {info['backoffs']} step-size backoffs" if info.get("backoffs") else ""
    backoffs += f", kept pass {info['best_epoch']}" if "best_epoch" in info else ""
    return (f"wrote {info['model']} in {info['seconds']:.1f} s ({chosen}{info['task']}, {info['n_passes']} passes"
            f"{clusters}{backoffs}{'; held out: ' + held if held else ''}"
            f"{'; last pass: training ' + training if training else ''})")


def _add_mask(p) -> None:
    p.add_argument("data_url", metavar="DATA_URL", help="fully labelled dataset store")
    p.add_argument("--observed", type=float, required=True, metavar="FRACTION", help="fraction in (0, 1], e.g. 0.2")
    _add_seed(p, "of the mask")
    _add_out(p, "dataset store")
    _add_json(p, "url, nnz_observed, observed_fraction")


def _cmd_mask(args) -> int:
    """Copy a dataset revealing a uniformly random fraction of its label entries (missing labels).

    Write a copy of a fully labelled dataset store in which each of the n x L label entries is observed
    independently with probability --observed (LEML's missing-label simulation): Y keeps the observed relevant
    labels and the CSR group 'observed' beside it stores the observed entries.
    """
    from .missing import mask_dataset

    info = mask_dataset(args.data_url, args.out, observed=args.observed, seed=args.seed, overwrite=args.overwrite)
    return _print(args, info, lambda info: (
        f"wrote {info['url']}: {info['nnz_observed']:,} observed entries ({100 * info['observed_fraction']:.2f}% "
        f"of n x L, seed {info['seed']}), {info['nnz_labels']:,} observed relevant labels"))


def _add_predict(p) -> None:
    from .cluster import add_cluster_arguments
    from .params import TOP_K

    p.add_argument("model_url", metavar="MODEL_URL", help="model store (xmldask train --out)")
    p.add_argument("data_url", metavar="DATA_URL", help="dataset store to predict, with the model's features")
    _add_out(p, "prediction store", "PRED_URL", progress=True)
    p.add_argument("--top-k", type=_positive, default=TOP_K, help=f"labels per row (default {TOP_K})")
    add_cluster_arguments(p)


def _cmd_predict(args) -> int:
    """Top-k labels and scores of every row of a dataset store, into a prediction store.

    Stream the rows of a dataset store through a model, block by block, into a prediction store holding the Zarr
    arrays labels (int32, n x top_k, best first) and scores (float32).
    """
    from . import jobs

    _refuse_target_early(args.out, "predictions", args.overwrite, [args.model_url, args.data_url])
    jobs.check_predict_inputs(args.model_url, args.data_url)
    with _cluster_context(args, args.data_url):
        info = jobs.predict(args.model_url, args.data_url, args.out, top_k=args.top_k, overwrite=args.overwrite,
                            progress=not args.no_progress)
    print(f"wrote {info['url']}: {info['n_samples']:,} rows x top {info['top_k']} in {info['seconds']:.1f} s "
          f"({info['rows_per_second']:,.0f} rows/s)")
    return 0


def _add_evaluate(p) -> None:
    p.add_argument("pred_url", metavar="PRED_URL", help="prediction store (xmldask predict --out)")
    p.add_argument("data_url", metavar="DATA_URL", help="the dataset store the predictions were made from")
    p.add_argument("--train", default=None, metavar="TRAIN_URL", help="training dataset for the propensities")
    p.add_argument("--ks", default="1,3,5", help="comma-separated k of the @k metrics (default 1,3,5)")
    p.add_argument("--propensity-a", type=float, default=0.55, metavar="A", help="default 0.55")
    p.add_argument("--propensity-b", type=float, default=1.5, metavar="B", help="default 1.5")
    _add_json(p, '"P@1", "P@3", "P@5"')


def _cmd_evaluate(args) -> int:
    """P@k, nDCG@k, PSP@k, recall, accuracy of a prediction store against a dataset's labels.

    Score a prediction store against the labels of a dataset store in one pass. Propensities (Jain et al. 2016) come
    from the training set's label counts: --train, else the training data recorded in the model, else the evaluated
    data.
    """
    from . import jobs, metrics

    try:
        ks = tuple(int(k) for k in args.ks.split(","))
    except ValueError:
        raise ValueError(f"--ks must be comma-separated integers such as 1,3,5, but is {args.ks!r}") from None
    results = jobs.evaluate(args.pred_url, args.data_url, train_url=args.train, ks=ks, A=args.propensity_a,
                            B=args.propensity_b)
    return _print(args, results, lambda results: metrics.report(results, title=f"{args.pred_url} on {args.data_url}"))


def _add_demo(p) -> None:
    p.add_argument("--root", default=None, help="storage root (default: $XMLDASK_STORAGE or ./storage)")
    p.add_argument("--n-samples", type=_positive, default=100_000, help="training rows (default 100000)")
    p.add_argument("--n-features", type=_positive, default=50_000, help="feature columns (default 50000)")
    p.add_argument("--n-labels", type=_positive, default=10_000, help="label columns (default 10000)")
    _add_seed(p)


def _cmd_demo(args) -> int:
    """Synthesize, ingest and summarise a dataset in storage/ (the main job, the whole pipeline, is python -m
    flows.pipeline).

    Generate a synthetic multilabel dataset as XC text files under the storage root, ingest them into dataset
    stores, and print their summary. Re-running reuses what is already there.
    """
    from .demo import run_demo

    run_demo(root=args.root, n_samples=args.n_samples, n_features=args.n_features, n_labels=args.n_labels,
             seed=args.seed)
    return 0


def _add_tree(p) -> None:
    from .params import TreeParams

    _add_fitting(p, TreeParams, "tree parameters", out=("tree store", "TREE_URL"),
                 keys="tree, seconds, n_passes, n_leaves, train_figures")


def _cmd_tree(args) -> int:
    """Grow a hierarchical spectral label tree (candidate-label filter) on a dataset store.

    Grow the label tree of Mineiro and Karampatziakis (2015) level by level over the row blocks: each node routes by
    the top eigenvector of eq. (2) and a weighted median; training rows are routed fractionally; a leaf keeps its
    most probable labels. Writes a tree store (a model store).
    """
    from . import jobs
    from .params import TreeParams, from_args

    params = from_args(args, TreeParams)
    _refuse_target_early(args.out, "model", args.overwrite, [args.train_url])
    with _cluster_context(args, args.train_url):
        info = jobs.tree(args.train_url, args.out, overwrite=args.overwrite, **params)
    return _print(args, info, _tree_text)


def _tree_text(info: dict) -> str:
    fig = info["train_figures"]
    return (f"wrote {info['tree']} in {info['seconds']:.1f} s ({info['n_passes']} passes, {info['n_leaves']} leaves, "
            f"{info['n_orphans']} orphans repaired; train tree recall {fig['tree_recall']:.4f}, mean depth "
            f"{fig['mean_depth']:.2f}, mean candidates {fig['mean_candidates']:.2f})")


def _add_tree_info(p) -> None:
    p.add_argument("tree_url", metavar="TREE_URL", help="tree store (xmldask tree --out)")
    p.add_argument("data_url", metavar="DATA_URL", help="dataset store to route through the tree")
    _add_json(p, "tree_recall, root_purity, mean_depth, mean_candidates, top_labels_recall")


def _cmd_tree_info(args) -> int:
    """Figures of a spectral label tree on a dataset store.

    Route every row of a dataset store through a tree (one pass) and report tree recall, root purity and balance,
    mean depth, mean candidates and the recall of the most frequent training labels.
    """
    from . import jobs

    info = jobs.tree_info(args.tree_url, args.data_url)
    return _print(args, info, lambda info: "\n".join(f"  {key:<18} {value:.4f}" if isinstance(value, float)
                                                     else f"  {key:<18} {value}" for key, value in info.items()))


# each command: the function adding its options, and the one running it, whose docstring is its help (the
# first paragraph, in ``xmldask --help``) and description (the rest, in ``xmldask COMMAND --help``)
_COMMANDS = {"ingest": (_add_ingest, _cmd_ingest), "synth": (_add_synth, _cmd_synth), "info": (_add_info, _cmd_info),
             "spectrum": (_add_spectrum, _cmd_spectrum), "train": (_add_train, _cmd_train),
             "predict": (_add_predict, _cmd_predict), "evaluate": (_add_evaluate, _cmd_evaluate),
             "demo": (_add_demo, _cmd_demo), "tree": (_add_tree, _cmd_tree),
             "tree-info": (_add_tree_info, _cmd_tree_info), "mask": (_add_mask, _cmd_mask)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xmldask",
        description="Extreme multi-label classification out of core: Zarr row-block stores on Dask.",
    )
    parser.add_argument("--version", action="version", version=f"xmldask {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add, run) in _COMMANDS.items():
        summary, _, description = inspect.cleandoc(run.__doc__).partition("\n\n")
        add(sub.add_parser(name, help=" ".join(summary.split()).rstrip("."), description=description))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # a long command's steps (search candidates, tree levels, classifier passes) as they finish; with -v
    # they come with the other log lines
    progress = contextlib.nullcontext() if args.verbose else progress_to(
        lambda line: print(line, file=sys.stderr, flush=True))
    try:
        with progress:
            return _COMMANDS[args.command][1](args)
    except (ParseError, StoreError, FileExistsError, FileNotFoundError, ValueError, ConnectionError,
            MemoryError, FloatingPointError) as exc:
        print(f"xmldask {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"xmldask {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
