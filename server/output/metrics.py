"""``fedpart server --metrics-port PORT``: the run's state for Prometheus, on its own HTTP port.

Nothing is counted on the way: :class:`RunCollector` reads, when it is scraped, what the server
keeps anyway: :meth:`Coordinator.progress` (stage, round, clients done, ETA), the process registry
(connected processes, ready clients), the byte ledger (bytes by direction and part, refused result
bytes), the insider monitor's outlier streaks, the failures list and the round records of
``metrics.jsonl``. A scrape takes the state machine's lock a few times, like the live progress
display; the rounds never wait for it.

The endpoint is plain HTTP without authentication, like most exporters: it shows counts and
progress, never tensors, tokens or client data. It needs ``prometheus-client`` (the ``metrics``
extra: ``pip install 'fedpart[metrics]'``), imported only when the port is asked for.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from fedpart.common.process.records import DeliveryCounts, RobustCounts, RoundRecord
from fedpart.server.policy.screening import RobustScreening

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from fedpart.server.engine.coordinator import Coordinator

STAGES = ("joining", "training", "evaluating")


class MetricsUnavailable(ImportError):
    """``--metrics-port`` without prometheus-client installed."""


def _prometheus():
    try:
        import prometheus_client
    except ImportError as error:
        raise MetricsUnavailable("--metrics-port needs prometheus-client: pip install 'fedpart[metrics]'") from error
    return prometheus_client


class RunCollector:
    """Prometheus metrics of one server's run, read from its state at each scrape.

    ``records`` is the list of round records the server appends to (``metrics.jsonl``: the
    rounds of a resumed run included)."""

    def __init__(self, coordinator: Coordinator, records: Sequence[RoundRecord]) -> None:
        self.coordinator = coordinator
        self.records = records

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        coordinator = self.coordinator
        config = coordinator.config
        progress = coordinator.progress()
        records = list(self.records)

        yield InfoMetricFamily("fedpart_run", "The run this server coordinates",
                               value={"run_id": coordinator.run_id, "name": config.name,
                                      "algorithm": config.algorithm.name})
        yield GaugeMetricFamily("fedpart_clients", "Clients of the run", value=config.clients)
        yield GaugeMetricFamily("fedpart_rounds", "Rounds the run is configured for", value=config.rounds)
        yield GaugeMetricFamily("fedpart_round", "The round in progress or last run (rounds + 1 during the "
                                "final evaluation)", value=progress.round)
        yield GaugeMetricFamily("fedpart_rounds_completed", "Rounds completed (those of a resumed run's earlier "
                                "servers included)", value=len(records))
        stage = GaugeMetricFamily("fedpart_stage", "1 for the stage the run is in", labels=["stage"])
        for name in STAGES:
            stage.add_metric([name], float(progress.stage == name))
        yield stage
        yield GaugeMetricFamily("fedpart_run_ended", "1 once the run is over (completed or ended early)",
                                value=float(coordinator.registry.done))
        yield GaugeMetricFamily("fedpart_stage_clients_done", "Clients done in the current stage: ready (joining), "
                                "answered of the sampled (training), evaluated (evaluating)", value=progress.done)
        yield GaugeMetricFamily("fedpart_stage_clients", "Clients the current stage waits for", value=progress.total)
        if progress.eta_seconds is not None:
            yield GaugeMetricFamily("fedpart_eta_seconds", "Estimated seconds until the last round ends",
                                    value=progress.eta_seconds)
        if records:
            yield GaugeMetricFamily("fedpart_last_round_seconds", "Duration of the last completed round",
                                    value=records[-1].seconds)
        yield CounterMetricFamily("fedpart_round_seconds", "Seconds of the completed rounds, summed",
                                  value=sum(r.seconds for r in records))

        registry = coordinator.registry
        yield GaugeMetricFamily("fedpart_connected_processes", "Client processes connected and alive",
                                value=registry.live_processes)
        admission = registry.admission
        refused = CounterMetricFamily("fedpart_refused", "Joins and calls the server refused, by reason (each "
                                      "logged with the peer's address)", labels=["reason"])
        for reason, count in sorted(admission.refused.items()):
            refused.add_metric([reason], count)
        yield refused
        yield CounterMetricFamily("fedpart_takeovers", "Joins that took over the session of a process that was "
                                  "gone", value=admission.takeovers)
        yield CounterMetricFamily("fedpart_admission_alerts", "Alert lines: one credential or peer refused or "
                                  "taking over again and again", value=admission.alerts)
        board = coordinator.board
        since = board.waiting_since
        yield GaugeMetricFamily("fedpart_waiting_clients", "Clients the current round (or step) still waits for",
                                value=len(board.waiting_for()) if since is not None else 0)
        yield GaugeMetricFamily("fedpart_waiting_seconds", "How long the current round (or step) has waited for "
                                "its clients", value=time.monotonic() - since if since is not None else 0.0)
        yield GaugeMetricFamily("fedpart_ready_clients", "Clients hosted by a live process that loaded its data",
                                value=registry.ready_clients)

        yield CounterMetricFamily("fedpart_results_sampled", "Clients sampled in the completed rounds",
                                  value=sum(len(r.sampled) for r in records))
        yield CounterMetricFamily("fedpart_results_folded", "Training results folded into the completed rounds",
                                  value=sum(len(r.completed) for r in records))
        robust = CounterMetricFamily("fedpart_results_robust", "Results the defences (robust.*) changed or "
                                     "refused in the completed rounds", labels=["action"])
        for action, count in RobustCounts.total(r.robust for r in records if r.robust is not None).to_json().items():
            robust.add_metric([action], count)
        yield robust
        screening = coordinator.policy.find(RobustScreening)
        monitor = screening.monitor if screening is not None else None
        if monitor is not None:
            streaks = monitor.streaks()
            streak = GaugeMetricFamily("fedpart_insider_outlier_streak", "Clients whose latest results were outliers "
                                       "(robust.monitor_*), and how many in a row", labels=["client"])
            for client, count in sorted(streaks.items()):
                streak.add_metric([str(client)], count)
            yield streak
            yield GaugeMetricFamily("fedpart_insiders_named", "Clients named by the insider monitor now: their latest "
                                    "robust.monitor_rounds results or more were all outliers",
                                    value=sum(count >= monitor.rounds for count in streaks.values()))
        delivery = CounterMetricFamily("fedpart_delivery", "What faults made the server do, by kind: tasks and "
                                       "results sent again, streams cut, duplicates dropped, tasks given up",
                                       labels=["kind"])
        totals = DeliveryCounts.total(r.delivery for r in records if r.delivery is not None)
        if progress.round > len(records):  # the round in progress, or the final evaluation
            totals += coordinator.board.delivery_counts(progress.round)
        for kind, count in sorted(totals.to_json().items()):
            delivery.add_metric([kind], count)
        yield delivery
        yield CounterMetricFamily("fedpart_refused_result_bytes", "Bytes of results the server refused (not "
                                  "traffic of any round)", value=coordinator.ledger.refused_bytes)
        yield GaugeMetricFamily("fedpart_failures", "Failures so far, as summary.json lists them: results "
                                "refused or lost, clients that left", value=len(coordinator.failures))

        sent = CounterMetricFamily("fedpart_bytes", "Serialized gRPC message bytes by direction (down: to the "
                                   "clients) and model part (control: everything but tensors)",
                                   labels=["direction", "part"])
        for part, counts in coordinator.ledger.by_part().items():
            for direction, count in counts.items():
                sent.add_metric([direction, part], count)
        yield sent


class MetricsServer:
    """The HTTP endpoint (``/metrics``) on a thread of its own."""

    def __init__(self, host: str, port: int, collector: RunCollector) -> None:
        prometheus = _prometheus()
        registry = prometheus.CollectorRegistry()
        registry.register(collector)
        prometheus.ProcessCollector(registry=registry)  # the server's CPU seconds, memory, open files
        self._httpd, self._thread = prometheus.start_http_server(port, addr=host, registry=registry)
        self.address = f"{host}:{self._httpd.server_address[1]}"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


def check_metrics_available() -> None:
    """Raise :class:`MetricsUnavailable` where prometheus-client is not installed."""
    _prometheus()
