"""The byte ledger: counts by round, client, direction and part add up however they are queried."""

import threading

from fedpart.server.output.accounting import PARTS, PROCESS, ByteLedger


def _filled() -> ByteLedger:
    ledger = ByteLedger()
    ledger.add(1, 0, "up", {"body": 10, "control": 2})
    ledger.add(1, 1, "down", {"head": 5, "other": 0})
    ledger.add(2, 0, "up", {"body": 7})
    ledger.add(2, PROCESS, "up", {"control": 3})
    return ledger


def test_totals_by_round_client_and_overall() -> None:
    ledger = _filled()
    assert ledger.totals() == {"down": 5, "up": 22}
    assert ledger.totals(1) == {"down": 5, "up": 12}
    assert ledger.totals(2) == {"down": 0, "up": 10}
    assert ledger.totals(client=0) == {"down": 0, "up": 19}
    assert ledger.totals(client=PROCESS) == {"down": 0, "up": 3}
    assert ledger.totals(1, 0) == {"down": 0, "up": 12}
    assert ledger.totals(7) == {"down": 0, "up": 0}


def test_by_part_always_lists_every_part_and_direction() -> None:
    ledger = _filled()
    parts = ledger.by_part()
    assert set(parts) == set(PARTS)
    assert parts["body"] == {"down": 0, "up": 17}
    assert parts["head"] == {"down": 5, "up": 0}
    assert parts["other"] == {"down": 0, "up": 0}
    assert parts["control"] == {"down": 0, "up": 5}
    assert ledger.by_part(2)["control"] == {"down": 0, "up": 3}
    assert ledger.by_part(client=1)["head"]["down"] == 5


def test_concurrent_adds_are_all_counted() -> None:
    ledger = ByteLedger()

    def add_many(client: int) -> None:
        for _ in range(2000):
            ledger.add(1, client, "up", {"body": 3, "control": 1})

    threads = [threading.Thread(target=add_many, args=(c,)) for c in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert ledger.totals() == {"down": 0, "up": 8 * 2000 * 4}
    assert all(ledger.totals(client=c)["up"] == 2000 * 4 for c in range(8))


def test_extra_model_parts_are_reported_once_they_carry_bytes():
    ledger = ByteLedger()
    ledger.add(1, 0, "down", {"body": 100, "personal_head": 7})
    ledger.add(1, 0, "up", {"body": 40})
    parts = ledger.by_part(1)
    assert list(parts) == [*PARTS, "personal_head"]
    assert parts["personal_head"] == {"down": 7, "up": 0}
    assert ledger.totals(1) == {"down": 107, "up": 40}
    assert ledger.by_part(client=0)["personal_head"]["down"] == 7
