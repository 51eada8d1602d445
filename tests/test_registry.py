"""The component registries: one reader for every kind's options, capabilities from a kind's
vocabulary, and the server's parts declared in common and implemented in the server."""

from __future__ import annotations

import pytest

from fedpart.common.components.registry import (
    KINDS,
    REQUIRED,
    Option,
    OptionError,
    Registry,
    coerce,
)


def _registry(**capabilities: str) -> Registry:
    registry = Registry("test part", "fedpart.common.components.registry", "Parts of a test.",
                        capabilities=capabilities)
    KINDS.pop("test part")  # a scratch kind: not one of fedpart's
    return registry


class Scaled:
    """A part with a scale."""

    fast = True

    def __init__(self, scale: float = 2.0) -> None:
        self.scale = scale


def test_only_an_exponent_yaml_left_a_string_is_read_as_a_number() -> None:
    assert coerce("1e-3", float, "k") == 1e-3 and coerce(" 5E+2 ", float, "k") == 500.0
    for text in ("0.1", "fast", "nan", "1e"):
        with pytest.raises(OptionError, match=f"k: expected a number, got '{text}'"):
            coerce(text, float, "k")
    assert coerce((1, 2), list, "k") == [1, 2]
    with pytest.raises(OptionError, match="k: expected a list, got 3"):
        coerce(3, list, "k")


def test_read_types_checks_and_names_every_option() -> None:
    registry = _registry()
    registry.add(registry.component("scaled", "A scale.", Scaled,
                                    Option("scale", float, "the scale", lambda v: v > 0, "must be > 0")))
    assert registry.read("scaled", {"scale": 3}, "part.", "part.name") == {"scale": 3.0}
    assert registry.read("scaled", {}, "part.", "part.name") == {}
    with pytest.raises(OptionError, match=r"^part.scale must be > 0$"):
        registry.read("scaled", {"scale": -1.0}, "part.", "part.name")
    with pytest.raises(OptionError, match=r"^part.size: not an option of test part 'scaled'; known: \['scale'\]$"):
        registry.read("scaled", {"size": 1}, "part.", "part.name")
    with pytest.raises(OptionError, match=r"^part: the options of test part 'scaled' must be a mapping, got 3$"):
        registry.read("scaled", 3, "part.", "part.name")
    with pytest.raises(OptionError, match=r"^part.name: unknown test part 'other'; known: scaled$"):
        registry.read("other", {}, "part.", "part.name")


def test_a_capability_comes_from_the_vocabulary_declared_or_as_a_true_attribute() -> None:
    registry = _registry(fast="it is fast", exact="it is exact")
    assert registry.component("scaled", "A scale.", Scaled).capabilities == {"fast"}
    assert registry.component("scaled", "A scale.", Scaled, capabilities=("exact",)).capabilities == {"fast", "exact"}
    with pytest.raises(OptionError, match="'slow' is not a capability of a test part; known: \\['exact', 'fast'\\]"):
        registry.component("scaled", "A scale.", Scaled, capabilities=("slow",))


def test_a_declared_part_is_checked_without_its_builder_and_built_once_implemented() -> None:
    registry = _registry(fast="it is fast")
    registry.declare("scaled", "A scale.", Option("scale", float, "the scale", default=2.0), capabilities=("fast",))
    assert registry.read("scaled", {"scale": 1}, "part.", "part.name") == {"scale": 1.0}
    with pytest.raises(OptionError, match="declared but not implemented in this process"):
        registry["scaled"]()
    registry.implement("scaled")(Scaled)
    assert registry["scaled"](scale=3.0).scale == 3.0 and registry["scaled"].capabilities == {"fast"}
    with pytest.raises(OptionError, match="needs an explicit default"):
        registry.declare("loose", "No default.", Option("scale", float))
    assert registry.declare("strict", "Required.", Option("scale", float, default=REQUIRED))


@pytest.mark.parametrize("declaration, message", [
    (dict(options=(Option("scale", float, default=1.0),), capabilities=("fast",)),
     "option 'scale' is declared with the default 1.0, its builder's is 2.0"),
    (dict(options=(Option("scale", float, default=2.0),), capabilities=()),
     "its builder's fast is True, its declaration says otherwise"),
])
def test_an_implementation_that_disagrees_with_its_declaration_is_refused(declaration, message) -> None:
    registry = _registry(fast="it is fast")
    registry.declare("scaled", "A scale.", *declaration["options"], capabilities=declaration["capabilities"])
    with pytest.raises(OptionError, match=message):
        registry.implement("scaled")(Scaled)
    with pytest.raises(OptionError, match="'other' is not declared"):
        registry.implement("other")(Scaled)


def test_the_server_parts_are_implemented_as_declared() -> None:
    """Importing the server's implementations passes every implement() check, and what the
    configuration reads (options, capabilities) is the implementations'."""
    from fedpart.common.components.registry import ROBUST_AGGREGATORS, SERVER_OPTIMIZERS
    from fedpart.server.policy import optimizers, robust  # noqa: F401  (their implement() calls)

    for registry in (SERVER_OPTIMIZERS, ROBUST_AGGREGATORS):
        assert all(component.build is not None for component in registry.builtin().values())
    assert SERVER_OPTIMIZERS["fedexp"].build.needs_result_norms
    assert "needs_result_norms" in SERVER_OPTIMIZERS["fedexp"].capabilities
    assert SERVER_OPTIMIZERS["feddyn"].capabilities == {"needs_result_counts"}
    assert SERVER_OPTIMIZERS["fedadam"]().tau == SERVER_OPTIMIZERS["fedadam"].defaults()["tau"]
    assert ROBUST_AGGREGATORS["mean"].capabilities == {"linear"} and not ROBUST_AGGREGATORS["median"].capabilities
