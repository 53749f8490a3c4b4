"""Prefect flows over a Dask cluster: the xmldask pipeline as flow runs, its report, and scheduled data refresh.

Modules
-------
stages
    Content fingerprints, store locations (paths or fsspec URLs) and the stage writer (no Prefect imports).
stage_flows
    One flow per stage (ingest, spectrum, train, predict, evaluate, report) over a thin task cached by
    Prefect on the stage fingerprint; the Dask client helper.
report
    Plots and the Markdown report of a run.
pipeline
    The ``pipeline`` flow chaining the stage flows; ``python -m flows.pipeline`` is the entry point.
refresh
    The ``refresh`` flow: ingest new files exactly once, retrain, promote the model if it is not worse.
deploy
    Serve the refresh flow on a cron schedule (``flow.serve``).

Importing this package sets quiet, offline Prefect defaults (no telemetry, no logs sent to the API, and
two minutes rather than 20 s for the temporary local API server to start on a loaded machine) unless the
environment already sets them; Prefect reads them when it is first imported.
"""

from __future__ import annotations

import os

for _name, _value in (("PREFECT_SERVER_ANALYTICS_ENABLED", "false"), ("DO_NOT_TRACK", "1"),
                      ("PREFECT_LOGGING_TO_API_ENABLED", "false"),
                      ("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")):
    os.environ.setdefault(_name, _value)
