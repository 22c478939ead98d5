"""Prometheus metrics of a run, from its coordinator only: ``etcslurm metrics``.

A collector that, on each scrape, folds what is new in the run's event stream and keys
into the monitor's own :class:`~etcslurm.monitor.model.RunModel` (through
:class:`~etcslurm.monitor.source.RunSource`: the same fold the monitor and ``status``
show) and turns the resulting view into metric families.  Read-only; a scrape while the
coordinator is unreachable keeps the last values and says ``etcslurm_coordinator_up 0``.
Every metric has the label ``run``.  docs/metrics.md lists them, with a scrape config and
alert rules.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from etcslurm.coord.records import RESIZE_CAUSES
from etcslurm.core.layout import ParallelConfig
from etcslurm.errors import EtcslurmError, LayoutError
from etcslurm.monitor.model import RunModel
from etcslurm.monitor.source import RunSource
from etcslurm.monitor.views import STATES, RunView


class RunCollector(Collector):
    """The metrics of one run (``prometheus_client`` custom collector)."""

    def __init__(self, source: RunSource, clock: Callable[[], float] = time.time) -> None:
        self.source = source
        self.model = RunModel(source.run)
        self.clock = clock
        self.up = False
        self.min_world: int | None = None
        self._lock = threading.Lock()

    def refresh(self) -> RunView:
        """Fold what is new in the coordinator; the view now (the last one on an outage)."""
        with self._lock:
            try:
                self.source.catch_up(self.model)
                spec = self.source.coord.run_spec() or {}
                self.min_world = int(spec["min_world"]) if spec.get("min_world") else None
                self.up = True
            except EtcslurmError:
                self.up = False
            return self.model.view(self.clock())

    def collect(self) -> Iterator[Any]:
        view = self.refresh()
        run = view.run
        labels = ["run"]

        def gauge(name: str, doc: str, value: float | None) -> Iterator[Any]:
            if value is not None:
                g = GaugeMetricFamily(f"etcslurm_{name}", doc, labels=labels)
                g.add_metric([run], float(value))
                yield g

        yield from gauge("coordinator_up", "1 when the last scrape read the coordinator",
                         1 if self.up else 0)
        yield from gauge("world_size", "ranks in the current generation", view.world)
        yield from gauge("min_world", "the run's min_world (fewer devices wait as standby)",
                         self.min_world)
        yield from gauge("generation", "the current generation", view.gen)
        yield from gauge("step", "the last step rank 0 reported", view.step)
        yield from gauge("tokens_per_second", "tokens per second of the last step",
                         view.tokens_per_s)
        yield from gauge("loss", "loss of the last step", view.loss)
        if view.last_step_ts is not None:
            yield from gauge("seconds_since_last_step", "seconds since rank 0 reported a step",
                             max(0.0, self.clock() - view.last_step_ts))
        if view.layout:
            info = InfoMetricFamily("etcslurm_layout", "the current layout", labels=labels)
            try:
                cfg = ParallelConfig.parse(view.layout)
                parts = {"tp": str(cfg.tp), "pp": str(cfg.pp), "dp": str(cfg.dp)}
            except LayoutError:
                parts = {}
            info.add_metric([run], {"layout": view.layout, **parts})
            yield info
        phase = InfoMetricFamily("etcslurm_run", "the run's phase", labels=labels)
        phase.add_metric([run], {"phase": view.phase})
        yield phase
        workers = GaugeMetricFamily("etcslurm_workers", "workers by state",
                                    labels=["run", "state"])
        counts = {s: 0 for s in STATES}
        for node in view.nodes:
            for d in node.devices:
                counts[d.state] = counts.get(d.state, 0) + 1
        for state, n in counts.items():
            workers.add_metric([run, state], n)
        yield workers
        resizes = CounterMetricFamily("etcslurm_resizes", "resizes by cause",
                                      labels=["run", "cause"])
        for cause in RESIZE_CAUSES:
            resizes.add_metric([run, cause], view.resizes.get(cause, 0))
        yield resizes
        mig = view.migration
        if mig is not None and mig.done:
            yield from gauge("last_pause_seconds", "training pause of the last resize",
                             mig.pause_seconds)
            yield from gauge("last_moved_bytes", "bytes the last resize moved", mig.moved_bytes)
        yield from gauge("last_moved_over_lower_bound",
                         "bytes the last resize moved / the planner's lower bound",
                         view.moved_vs_lower_bound)
        failovers = CounterMetricFamily("etcslurm_coordinator_failovers",
                                        "changes of the coordinator's primary seen",
                                        labels=labels)
        failovers.add_metric([run], view.failovers)
        yield failovers
        if self.model.primary:
            primary = InfoMetricFamily("etcslurm_coordinator_primary",
                                       "the replicated coordinator's primary", labels=labels)
            primary.add_metric([run], {"primary": self.model.primary})
            yield primary


def serve(collector: RunCollector, port: int, addr: str = "0.0.0.0") -> tuple[Any, int]:
    """Serve ``/metrics`` in a daemon thread; returns (server, port bound)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server, int(server.server_address[1])
