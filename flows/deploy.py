"""Serve the refresh flow on a cron schedule with ``flow.serve``.

``flow.serve`` registers a deployment with the Prefect API and runs its scheduled runs in this process
until it is stopped (Ctrl-C). The schedule is kept by the API server: start one first and point the
client at it::

    prefect server start &                                   # the UI at http://127.0.0.1:4200
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    python -m flows.deploy --test storage/refresh/test.zarr --cron "0 * * * *"

Files dropped into ``<storage>/refresh/incoming/`` are then picked up at every scheduled run (see
:mod:`flows.refresh`); ``prefect deployment run 'xmldask-refresh/xmldask-refresh'`` starts one now.
"""

from __future__ import annotations

import argparse

from prefect.deployments.runner import EntrypointType

__all__ = ["build_deployment", "deployment_options", "main", "serve"]


def deployment_options(*, cron: str, test: list[str], name: str = "xmldask-refresh", **parameters) -> dict:
    """The deployment of :func:`flows.refresh.refresh`: name, cron schedule, default parameters, description.

    :func:`serve` passes these to ``refresh.serve`` and :func:`build_deployment` to ``refresh.to_deployment``.
    """
    return {"name": name, "cron": cron, "parameters": {"test": list(test), **parameters}, "tags": ["xmldask"],
            "description": "Ingest new files of the incoming folder once, retrain, promote if not worse.",
            # a run started without this process (``python -m prefect.engine``) imports ``flows.refresh``
            # as a module of the package (its relative imports need it), not as a script file
            "entrypoint_type": EntrypointType.MODULE_PATH}


def build_deployment(*, cron: str, test: list[str], name: str = "xmldask-refresh", **parameters):
    """The refresh deployment as a ``RunnerDeployment`` (no API call): inspect it, or ``prefect.serve`` it."""
    from .refresh import refresh

    return refresh.to_deployment(**deployment_options(cron=cron, test=test, name=name, **parameters))


def serve(*, cron: str, test: list[str], name: str = "xmldask-refresh", **parameters) -> None:
    """Serve :func:`flows.refresh.refresh` on ``cron`` with these default parameters (blocks; ``flow.serve``)."""
    from .refresh import refresh

    refresh.serve(**deployment_options(cron=cron, test=test, name=name, **parameters))


def build_parser() -> argparse.ArgumentParser:
    from .stage_flows import add_command_line_options

    parser = argparse.ArgumentParser(prog="python -m flows.deploy", description="Serve the xmldask refresh flow on "
                                     "a cron schedule (needs a Prefect API: prefect server start).")
    parser.add_argument("--cron", default="0 * * * *", help="cron schedule (default hourly: '0 * * * *')")
    parser.add_argument("--test", nargs="+", required=True, metavar="SOURCE_OR_URL", help="held-out test set")
    parser.add_argument("--name", default="xmldask-refresh", help="deployment name")
    parser.add_argument("--incoming", help="folder of new files (default <storage>/refresh/incoming)")
    parser.add_argument("--metric", default="P@1", help="held-out metric of the promotion rule")
    add_command_line_options(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    import os
    import signal
    import sys

    from prefect.settings import get_current_settings

    from .stage_flows import parse_command_line

    args, model, given = parse_command_line(build_parser(), argv, skip=("cron", "name"))
    if not get_current_settings().api.url:
        # a temporary server keeps no schedule, and the terminal's Ctrl-C would stop it under the runner
        print("python -m flows.deploy: a schedule needs a Prefect server: run `prefect server start` and "
              "`export PREFECT_API_URL=http://127.0.0.1:4200/api` first", file=sys.stderr)
        return 2
    parameters = {name: value for name, value in given.items() if value is not None}

    def interrupted(signum, frame):
        if interrupted.seen:
            os._exit(130)
        interrupted.seen = True
        raise KeyboardInterrupt  # the runner pauses the deployment and stops

    interrupted.seen = False
    signal.signal(signal.SIGINT, interrupted)
    serve(cron=args.cron, name=args.name, **parameters, **({"model": model} if model else {}))
    if interrupted.seen:
        print(f"python -m flows.deploy: interrupted; the deployment {args.name!r} is paused until it is served "
              "again", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
