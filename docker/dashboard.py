"""rq-dashboard for pagedq: RQ's JSON serializer on every page, never pickle.

`RQ_DASHBOARD_JSON=true` makes rq-dashboard's job and queue pages read jobs as JSON, but some
paths (the workers page: `Worker.all()` then `worker.get_current_job()`) still resolve RQ's
default serializer, which is pickle: they fail on pagedq's JSON jobs and would unpickle
whatever anyone wrote into Redis. Making JSON the default before rq-dashboard is imported
covers every path (`resolve_serializer(None)` returns the module's `PickleSerializer`).
"""

import rq.serializers

rq.serializers.DefaultSerializer = rq.serializers.JSONSerializer
rq.serializers.PickleSerializer = rq.serializers.JSONSerializer

from rq_dashboard.cli import main  # noqa: E402  (after the serializer is replaced)

if __name__ == "__main__":
    main()
