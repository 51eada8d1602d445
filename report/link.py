"""Time on a link: the exact bytes of each round turned into the time the round would take on a
given network, and the time each run needs to reach an accuracy (docs/reports.md, "Time on a link").

The model, per round, over the round's clients that completed (those with measured compute):

- a client's download starts when the round starts, its training (the ``compute_seconds`` it
  measured) when the download ends, its upload when training ends; its time is the end of its
  upload plus ``round_trips`` x RTT (by default 2: the call that fetches the task and the call
  that uploads the result);
- a transfer runs at its client's link rate (``downlink`` or ``uplink``); clients are in parallel;
- with a shared server link of rate S, the server's link carries every transfer of the round in
  that direction at once, shared fairly (processor sharing): n transfers in flight move at
  ``min(client rate, S / n)`` each; uploads join as their clients finish training;
- the round takes as long as its slowest client. Server-side work (aggregation) is not modelled.

A client's bytes are its logical bytes where the round record has them (``logical_down`` /
``logical_up``: every tensor and control message the client needs, as if it were its own device),
else the physical ones (what crossed its process's connection: a process hosting several clients
downloads a changed tensor once, for its first client).

Process-level control bytes (joins, heartbeats, idle polls: client -1 of the byte ledger) are
left out: they belong to no client's critical path, as processes send them while their clients
train; the report states how many bytes that is. Sampled clients that did not complete (their
round closed at a timeout or a lost heartbeat, which no link model predicts) are left out too.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fedpart.common.process.records import RoundClient, RoundRecord

BITS_PER_BYTE = 8
ROUND_TRIPS = 2  # per client and round: fetching the task, uploading the result

# Decimal units, as network rates are quoted (tc's names): bits per second.
RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_QUANTITY = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([a-zA-Z]*)\s*")


def _quantity(text: str, units: Mapping[str, float], option: str, what: str) -> float:
    match = _QUANTITY.fullmatch(text)
    unit = match.group(3).lower() if match else ""
    if match is None or unit not in units:
        raise ValueError(f"{option} {text!r}: not a {what} (a number and one of {', '.join(units)}, e.g. "
                         f"{'10Mbit' if what == 'rate' else '50ms'})")
    number = float(match.group(1)) * 10 ** int(match.group(2) or 0)
    return number * units[unit]


def parse_rate(text: str, option: str = "rate") -> float:
    """``10Mbit`` -> 1e7 (bits per second); the rate must be positive."""
    bits = _quantity(text, RATE_UNITS, option, "rate")
    if not bits > 0 or math.isinf(bits):
        raise ValueError(f"{option} {text!r}: a rate must be positive and finite")
    return bits


def parse_duration(text: str, option: str = "duration") -> float:
    """``50ms`` -> 0.05 (seconds)."""
    seconds = _quantity(text, TIME_UNITS, option, "duration")
    if math.isinf(seconds):
        raise ValueError(f"{option} {text!r}: a duration must be finite")
    return seconds


def _rate_text(bits: float) -> str:
    for unit, scale in (("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}/s"
    return f"{bits:g} bit/s"


@dataclass(frozen=True)
class Link:
    """Every client's link (rates in bits per second, RTT in seconds) and, when set, the server's
    shared link (the same rate in both directions)."""

    downlink: float
    uplink: float
    rtt: float
    server: float | None = None
    round_trips: int = ROUND_TRIPS

    @classmethod
    def from_options(cls, link: str | None = None, uplink: str | None = None, downlink: str | None = None,
                     rtt: str | None = None, server: str | None = None,
                     round_trips: int = ROUND_TRIPS) -> Link | None:
        """``--link RATE/RTT`` (both directions), refined or replaced by ``--uplink``,
        ``--downlink`` and ``--rtt``; None when no link option is given."""
        if link is None and uplink is None and downlink is None:
            if rtt is not None or server is not None:
                raise ValueError("--rtt and --server-link need a client link: --link RATE/RTT, or --uplink "
                                 "and --downlink")
            return None
        both = latency = None
        if link is not None:
            rate_text, slash, rtt_text = link.partition("/")
            if not slash:
                raise ValueError(f"--link {link!r}: expected RATE/RTT, e.g. 10Mbit/50ms")
            both, latency = parse_rate(rate_text, "--link"), parse_duration(rtt_text, "--link")
        up = parse_rate(uplink, "--uplink") if uplink is not None else both
        down = parse_rate(downlink, "--downlink") if downlink is not None else both
        if up is None or down is None:
            raise ValueError("without --link both --uplink and --downlink are needed")
        latency = parse_duration(rtt, "--rtt") if rtt is not None else (latency or 0.0)
        if round_trips < 0:
            raise ValueError(f"--round-trips {round_trips}: must be >= 0")
        return cls(down, up, latency, parse_rate(server, "--server-link") if server is not None else None,
                   round_trips)

    def describe(self) -> str:
        text = (f"downlink {_rate_text(self.downlink)}, uplink {_rate_text(self.uplink)}, "
                f"RTT {self.rtt * 1e3:g} ms x {self.round_trips} round trips per round")
        if self.server is None:
            return text + "; the server's link is not a bottleneck"
        return text + f"; the server's link, {_rate_text(self.server)} each direction, is shared by all clients"


@dataclass(frozen=True)
class ClientRound:
    """One client's share of a round: bytes down and up, measured training seconds."""

    down: int
    up: int
    compute_seconds: float


@dataclass(frozen=True)
class RoundTime:
    """A round's modelled time and its slowest client's parts of it (seconds)."""

    seconds: float
    slowest: int
    download: float
    compute: float
    upload: float
    latency: float


def _shared_finish(starts: Mapping[int, float], sizes: Mapping[int, float], client_rate: float,
                   server_rate: float | None) -> dict[int, float]:
    """When each transfer ends: transfer ``i`` of ``sizes[i]`` bits starts at ``starts[i]``; the
    transfers in flight move at ``min(client_rate, server_rate / n)`` each (processor sharing;
    every transfer at ``client_rate`` when the server link is not shared). Event-driven: every
    transfer in flight gets the same rate, so a "virtual clock" of bits served per transfer orders
    the ends, O(n log n)."""
    if server_rate is None:
        return {i: starts[i] + sizes[i] / client_rate for i in sizes}
    arrivals = sorted(sizes, key=lambda i: (starts[i], i))
    finish: dict[int, float] = {}
    flight: list[tuple[float, int]] = []  # (virtual clock at which the transfer is done, client)
    now = virtual = 0.0
    index = 0
    while index < len(arrivals) or flight:
        rate = min(client_rate, server_rate / len(flight)) if flight else 0.0
        next_arrival = starts[arrivals[index]] if index < len(arrivals) else math.inf
        next_end = now + (flight[0][0] - virtual) / rate if flight else math.inf
        if next_end <= next_arrival:
            virtual, now = flight[0][0], next_end
            while flight and flight[0][0] <= virtual:
                finish[heapq.heappop(flight)[1]] = now
        else:
            virtual += rate * (next_arrival - now)
            now = next_arrival
            client = arrivals[index]
            index += 1
            heapq.heappush(flight, (virtual + sizes[client], client))
    return finish


def round_time(link: Link, clients: Mapping[int, ClientRound]) -> RoundTime | None:
    """The modelled time of a round whose completed clients are ``clients`` (None: no client)."""
    if not clients:
        return None
    down_bits = {c: BITS_PER_BYTE * r.down for c, r in clients.items()}
    up_bits = {c: BITS_PER_BYTE * r.up for c, r in clients.items()}
    downloaded = _shared_finish(dict.fromkeys(clients, 0.0), down_bits, link.downlink, link.server)
    trained = {c: downloaded[c] + clients[c].compute_seconds for c in clients}
    uploaded = _shared_finish(trained, up_bits, link.uplink, link.server)
    latency = link.round_trips * link.rtt
    slowest = max(clients, key=lambda c: (uploaded[c], -c))
    return RoundTime(seconds=uploaded[slowest] + latency, slowest=slowest, download=downloaded[slowest],
                     compute=clients[slowest].compute_seconds, upload=uploaded[slowest] - trained[slowest],
                     latency=latency)


def completed_clients(record: RoundRecord, logical: bool = True) -> dict[int, ClientRound]:
    """The round record's clients that completed, with their bytes (logical where ``logical`` and
    recorded, else physical) and compute seconds."""
    entries = record.clients or {}
    return {int(c): ClientRound(_client_bytes(e, "down", logical), _client_bytes(e, "up", logical),
                                e.compute_seconds)
            for c, e in entries.items() if e.compute_seconds is not None}


def _client_bytes(entry: RoundClient, direction: str, logical: bool) -> int:
    if logical and entry.logical_bytes_in(direction) is not None:
        return entry.logical_bytes_in(direction)
    return entry.bytes_in(direction)


def uses_logical_bytes(records: Sequence[RoundRecord]) -> bool:
    """Every client entry of every round record has logical bytes (the model then uses them)."""
    return bool(records) and all(e.logical_down is not None and e.logical_up is not None
                                 for r in records for e in (r.clients or {}).values())


def process_bytes(record: RoundRecord) -> int:
    """Bytes of the round that belong to no client (process-level control, left out of the model)."""
    entries = (record.clients or {}).values()
    return record.bytes_down + record.bytes_up - sum(e.down + e.up for e in entries)


def round_times(link: Link, records: Sequence[RoundRecord],
                logical: bool = True) -> list[RoundTime | None]:
    """The modelled time of every round record (None for a round with no completed client), from
    logical bytes where ``logical`` and recorded, else physical ones."""
    return [round_time(link, completed_clients(r, logical)) for r in records]


def cumulative_seconds(times: Sequence[RoundTime | None]) -> list[float]:
    """Modelled time at the end of each round (a round with no completed client adds nothing)."""
    total, out = 0.0, []
    for time in times:
        total += time.seconds if time is not None else 0.0
        out.append(total)
    return out


def time_to_accuracy(records: Sequence[RoundRecord], cumulative: Sequence[float],
                     target: float) -> float | None:
    """Time (``cumulative``: at the end of each round, modelled or the run's clock) at the end of
    the first round whose global accuracy reaches ``target`` (None: never reached in the rounds
    that were tested)."""
    for record, seconds in zip(records, cumulative):
        accuracy = record.global_accuracy()
        if accuracy is not None and accuracy >= target:
            return seconds
    return None


def default_target(accuracies: Sequence[Sequence[float]]) -> float | None:
    """The highest accuracy every run reaches: the lowest of the runs' best per-round accuracies
    (runs without accuracy per round are left out; None when no run has any)."""
    best = [max(a) for a in accuracies if a]
    return min(best) if best else None
