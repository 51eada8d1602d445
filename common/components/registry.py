"""One shape for every pluggable part: a named component with a one-line description, the
options it declares and the capabilities it has, in a registry of its kind.

A component (:class:`Component`) is a builder registered under a name; its options
(:class:`Option`: name, type, default, check) are read by one reader, :meth:`Registry.read`,
that types them and names the offending key in every error: the run config's check and every
builder that takes options from elsewhere (an algorithm's, a dataset's, a model's) go through it.
A component's capabilities (:attr:`Component.capabilities`, from its kind's vocabulary,
:attr:`Registry.capabilities`) are what other checks ask of it, never its name. What a run
config may name depends on the kind (:attr:`Registry.paths`): a component's name for every
kind; for codecs, server optimizers, robust aggregators and algorithms (:data:`BY_COMPONENT`)
also a ``package.module:name`` path to a :class:`Component` of a module outside fedpart, made
by that kind's :meth:`Registry.component`, which is then registered under its own name (so that,
for example, a plug-in codec's encoding is known to the receiver that configured it); for
datasets and models (:data:`BY_FUNCTION`) a path to a plain function, which their own loaders
call (the registry lists the built-in ones only); partition schemes, objective terms and step
rules take built-in names only.

Each kind's registry is declared here with the module that registers its built-in components
(its *home*), imported by name at the first lookup; every home is in ``fedpart.common``. The
server's kinds (server optimizers, robust aggregators) are *declared* there
(:mod:`fedpart.common.components.server_parts`: names, options, capabilities, which is all a run config's
check reads) and *implemented* by the server (:meth:`Registry.implement`), so that validating a
config imports no server module. :mod:`lab.reference` writes the reference of every
kind (docs/components.md).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fedpart.common.components.importing import import_attribute

FROM_BUILDER: Any = type("FromBuilder", (), {"__repr__": lambda self: "FROM_BUILDER"})()
"""An :class:`Option` default that is the builder's own default for the parameter."""

REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "REQUIRED"})()
"""An :class:`Option` default that says the option must be given."""

_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list"}

# A number YAML 1.1 reads as a string: an exponent without a dot (1e-3)
_YAML_EXPONENT = re.compile(r"[-+]?[0-9]+[eE][-+]?[0-9]+")


BY_NAME = ""
"""A :attr:`Registry.paths`: the kind's built-in names only."""

BY_FUNCTION = "function"
"""A :attr:`Registry.paths`: a ``package.module:function`` path names a plain function, which the
kind's own loader calls (datasets, models); the registry holds the built-in components only."""

BY_COMPONENT = "component"
"""A :attr:`Registry.paths`: a ``package.module:name`` path names a :class:`Component` of the
kind, made by :meth:`Registry.component`, which :meth:`Registry.resolve` imports and registers."""


class OptionError(ValueError):
    """A component or option that cannot be used; the message names the setting."""


def coerce(value: Any, kind: type, key: str) -> Any:
    """``value`` as a ``kind`` (bool, int, float, str or list; an int, or an exponent YAML 1.1
    left a string, is a float; a tuple is a list), else an OptionError naming ``key``."""
    if kind is float and isinstance(value, str) and _YAML_EXPONENT.fullmatch(value.strip()):
        return float(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is list and isinstance(value, tuple):
        return list(value)
    if kind not in _KIND_NAMES:
        raise OptionError(f"{key}: unsupported setting type {kind}")
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise OptionError(f"{key}: expected {_KIND_NAMES[kind]}, got {value!r}")
    return value


def finite_positive(value: float) -> bool:
    """A check: a finite number > 0."""
    return math.isfinite(value) and value > 0


def non_negative(value: float) -> bool:
    """A check: a number >= 0."""
    return value >= 0


def at_least_one(value: int) -> bool:
    """A check: an integer >= 1."""
    return value >= 1


@dataclass(frozen=True)
class Option:
    """One option of a component: its type, its default (:data:`FROM_BUILDER`: the builder's;
    :data:`REQUIRED`: none), a check of a given value and the rule it enforces as the end of a
    sentence (``"must be in [0, 1)"``), and a one-line description."""

    name: str
    kind: type
    help: str = ""
    check: Callable[[Any], bool] | None = None
    rule: str = ""
    default: Any = FROM_BUILDER

    def take(self, value: Any, key: str) -> Any:
        """``value`` typed and checked, else an OptionError naming ``key``; None where the
        default is None (the option unset)."""
        if value is None and self.default is None:
            return None
        value = coerce(value, self.kind, key)
        if self.check is not None and not self.check(value):
            raise OptionError(f"{key} {self.rule}")
        return value


@dataclass(frozen=True)
class Component:
    """A named builder with its declared options, made by its kind's :meth:`Registry.component`
    (or declared by :meth:`Registry.declare` and given its builder by :meth:`Registry.implement`:
    ``build`` is None until then). ``check`` returns what is wrong with a whole set of options
    (rules over several of them), or None; ``not_by_name``, where set, says why a run config
    cannot select the component by name (another setting brings it); ``capabilities``: the
    names of its kind's vocabulary that it has (:attr:`Registry.capabilities`)."""

    name: str
    description: str
    build: Callable[..., Any] | None
    options: tuple[Option, ...] = ()
    check: Callable[[Mapping[str, Any]], str | None] | None = None
    not_by_name: str = ""
    kind: str = ""  # the kind of registry it belongs to (see Registry.component)
    capabilities: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        object.__setattr__(self, "__doc__", self.description)  # help() and listings show what it does
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))
        if self.build is None:
            unresolved = [o.name for o in self.options if o.default is FROM_BUILDER]
            if unresolved:
                raise OptionError(f"{self.kind} {self.name!r} is declared without a builder: its option "
                                  f"{unresolved[0]!r} needs an explicit default (or REQUIRED)")
            return
        parameters = inspect.signature(self.build).parameters
        resolved = tuple(replace(o, default=_builder_default(parameters, o.name)) if o.default is FROM_BUILDER
                         else o for o in self.options)
        object.__setattr__(self, "options", resolved)

    def defaults(self) -> dict[str, Any]:
        """The default of every option that has one."""
        return {o.name: o.default for o in self.options if o.default is not REQUIRED}

    def __call__(self, **options: Any) -> Any:
        """The component built with ``options`` over the defaults."""
        if self.build is None:
            raise OptionError(f"{self.kind} {self.name!r} is declared but not implemented in this process (the "
                              "module that implements it registers its builder with the registry's implement())")
        return self.build(**{**self.defaults(), **options})


def describe(build: Callable[..., Any]) -> str:
    """The first sentence of ``build``'s docstring, on one line: a component's description where
    its builder documents it already."""
    paragraph = " ".join((build.__doc__ or "").strip().split("\n\n")[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[:end + 1]


def _builder_default(parameters: Mapping[str, inspect.Parameter], name: str) -> Any:
    parameter = parameters.get(name)
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return REQUIRED
    return parameter.default


class Options:
    """Reads a component's options, rejecting unknown ones and wrong types with the setting's
    name (behind :meth:`Registry.read`)."""

    def __init__(self, prefix: str, name: str, options: Mapping[str, Any]) -> None:
        self.prefix = prefix
        self.name = name
        self.remaining = dict(options)

    def read(self, declared: Sequence[Option]) -> dict[str, Any]:
        """The given options of ``declared``, typed and checked (defaults are not filled in)."""
        known = sorted(o.name for o in declared)
        for key in self.remaining:
            if key not in known:
                raise OptionError(f"{self.prefix}{key}: not an option of {self.name}; known: {known or 'none'}")
        return {o.name: o.take(self.remaining.pop(o.name), f"{self.prefix}{o.name}")
                for o in declared if o.name in self.remaining}


KINDS: dict[str, "Registry"] = {}
"""Every kind's registry by kind name, in the order they were declared."""


class Registry(Mapping[str, Component]):
    """The components of one kind by name (built-in ones, and plug-ins once resolved by path).
    ``home`` registers the built-in components; it is imported at the first lookup. ``paths``
    says what a ``package.module:name`` path at the kind's setting names (:data:`BY_COMPONENT`,
    :data:`BY_FUNCTION`, or :data:`BY_NAME`: none); ``defaults_needed``, where set, says why every
    option of a component of this kind needs a default (a component with a required option is
    then refused when it is made or registered); ``capabilities``: the capabilities a component
    of this kind may have, each with what it means (a builder has one where it has a true
    attribute of that name, or where its declaration names it)."""

    def __init__(self, kind: str, home: str, description: str, paths: str = BY_NAME,
                 defaults_needed: str = "", capabilities: Mapping[str, str] | None = None) -> None:
        if paths not in (BY_NAME, BY_FUNCTION, BY_COMPONENT):
            raise ValueError(f"paths must be BY_NAME, BY_FUNCTION or BY_COMPONENT, got {paths!r}")
        self.kind = kind
        self.home = home
        self.description = description
        self.paths = paths
        self.defaults_needed = defaults_needed
        self.capabilities: Mapping[str, str] = dict(capabilities or {})
        self._builtin: dict[str, Component] = {}
        self._plugins: dict[str, Component] = {}  # by name, once resolved by path
        self._paths: dict[str, Component] = {}
        KINDS[kind] = self

    def accepts(self) -> str:
        """What a run config may name for this kind, as a sentence (docs/components.md)."""
        if self.paths == BY_COMPONENT:
            return ("A run config names one of these, or a `package.module:name` path to a `fedpart.api.Component` "
                    "made by this kind's registry (`component()`), which selects a component from outside fedpart "
                    "(docs/plugins.md).")
        if self.paths == BY_FUNCTION:
            return ("A run config names one of these, or a `package.module:function` path to a plain function (not "
                    "a `fedpart.api.Component`), which fedpart calls instead (docs/plugins.md).")
        return "Built-in names only: no `package.module:name` path selects one."

    def _admit(self, component: Component) -> Component:
        """``component``, unless this kind needs a default for every option and one has none, or
        it claims a capability outside this kind's vocabulary."""
        if self.defaults_needed:
            required = [o.name for o in component.options if o.default is REQUIRED]
            if required:
                raise OptionError(f"{self.kind} {component.name!r}: option {required[0]!r} has no default, and every "
                                  f"option of a {self.kind} needs one: {self.defaults_needed}")
        unknown = sorted(component.capabilities - set(self.capabilities))
        if unknown:
            raise OptionError(f"{self.kind} {component.name!r}: {unknown[0]!r} is not a capability of a {self.kind}; "
                              f"known: {sorted(self.capabilities) or 'none'}")
        return component

    def add(self, component: Component, plugin: bool = False) -> Component:
        """Register ``component`` under its name (the same component again is a no-op)."""
        self._admit(component)
        held = self._builtin.get(component.name) or self._plugins.get(component.name)
        if held is not None and held is not component:
            raise OptionError(f"{self.kind} {component.name!r} is registered already ({held.build!r})")
        (self._plugins if plugin else self._builtin)[component.name] = component
        return component

    def _capabilities_of(self, build: Callable[..., Any] | None, declared: Iterable[str]) -> frozenset[str]:
        """``declared`` plus every capability of this kind that ``build`` has as a true attribute."""
        return frozenset(declared) | {name for name in self.capabilities if getattr(build, name, False) is True}

    def component(self, name: str, description: str, build: Callable[..., Any], *options: Option,
                  capabilities: Iterable[str] = (), **extra: Any) -> Component:
        """A component of this kind (not registered: a plug-in module holds it, a run config names
        it by ``package.module:name``); its capabilities are ``capabilities`` and those ``build``
        has as true attributes."""
        return self._admit(Component(name, description, build, options, kind=self.kind,
                                     capabilities=self._capabilities_of(build, capabilities), **extra))

    def register(self, name: str, description: str, *options: Option, **extra: Any) -> Callable[[Any], Any]:
        """A decorator that registers a builder (a class or a function) and returns it unchanged."""
        def decorate(build: Any) -> Any:
            self.add(self.component(name, description, build, *options, **extra))
            return build
        return decorate

    def declare(self, name: str, description: str, *options: Option, capabilities: Iterable[str] = (),
                **extra: Any) -> Component:
        """Register the built-in component ``name`` without its builder (every option with an
        explicit default or REQUIRED): what a run config's check needs of it, in a module that
        the configuration may import; :meth:`implement` gives it its builder."""
        return self.add(Component(name, description, None, options, kind=self.kind,
                                  capabilities=frozenset(capabilities), **extra))

    def implement(self, name: str) -> Callable[[Any], Any]:
        """A decorator that gives the declared component ``name`` its builder and returns the
        builder unchanged; refused where the builder's defaults or capability attributes
        disagree with the declaration."""
        def attach(build: Any) -> Any:
            declared = self.builtin().get(name)
            if declared is None:
                raise OptionError(f"{self.kind} {name!r} is not declared: declare it in {self.home}")
            parameters = inspect.signature(build).parameters
            for option in declared.options:
                own = _builder_default(parameters, option.name)
                if own is not REQUIRED and own != option.default:
                    raise OptionError(f"{self.kind} {name!r}: option {option.name!r} is declared with the default "
                                      f"{option.default!r}, its builder's is {own!r}")
            for capability in self.capabilities:
                own = getattr(build, capability, None)
                if isinstance(own, bool) and own != (capability in declared.capabilities):
                    raise OptionError(f"{self.kind} {name!r}: its builder's {capability} is {own}, its declaration "
                                      "says otherwise")
            if declared.build not in (None, build):
                raise OptionError(f"{self.kind} {name!r} is implemented already ({declared.build!r})")
            self._builtin[name] = replace(declared, build=build)
            return build
        return attach

    def builtin(self) -> dict[str, Component]:
        """fedpart's own components of this kind (those its home registers), by name."""
        importlib.import_module(self.home)
        return self._builtin

    def _loaded(self) -> dict[str, Component]:
        return {**self.builtin(), **self._plugins}

    def __getitem__(self, name: str) -> Component:
        """A registered component, by name or by a path already resolved (never imports a path:
        a name that came over the wire only finds what this process configured)."""
        found = self._paths.get(name) or self._loaded().get(name)
        if found is None:
            raise KeyError(name)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())

    def selectable(self) -> list[str]:
        """fedpart's own names that a run config may select."""
        return [name for name, c in self.builtin().items() if not c.not_by_name]

    def resolve(self, name: str, setting: str) -> Component:
        """The component a run config names at ``setting``: a selectable name, or (where
        :attr:`paths` is :data:`BY_COMPONENT`) a ``package.module:name`` path to a
        :class:`Component`, which is registered too."""
        if ":" in name and self.paths == BY_COMPONENT:
            return self._plug_in(name, setting)
        component = self.builtin().get(name)
        if component is None or component.not_by_name:
            hint = f" ({component.not_by_name})" if component is not None else ""
            path = {BY_COMPONENT: ", or a 'package.module:name' path",
                    BY_FUNCTION: ", or a 'package.module:function' path"}.get(self.paths, "")
            if not path and ":" in name:
                path = " (built-in names only: no 'package.module:name' path)"
            raise OptionError(f"{setting}: unknown {self.kind} {name!r}; known: {', '.join(self.selectable())}"
                              f"{path}{hint}")
        return component

    def _plug_in(self, path: str, setting: str) -> Component:
        if path not in self._paths:
            try:
                component = import_attribute(path, setting)
            except (ImportError, ValueError) as error:
                raise OptionError(str(error)) from error
            if not isinstance(component, Component) or component.kind != self.kind:
                article = "an" if self.kind[0] in "aeiou" else "a"
                raise OptionError(f"{setting} {path!r} is not {article} {self.kind}: a Component made by the "
                                  f"{self.kind} registry's component()")
            self._paths[path] = self.add(component, plugin=True)
        return self._paths[path]

    def read(self, name: str, options: Mapping[str, Any], prefix: str, setting: str) -> dict[str, Any]:
        """The given ``options`` of the component ``name`` (at ``setting``), typed and checked,
        with errors naming ``prefix`` + the option."""
        component = self.resolve(name, setting)
        if not isinstance(options, Mapping):
            raise OptionError(f"{prefix.rstrip('.')}: the options of {self.kind} {name!r} must be a mapping, "
                              f"got {options!r}")
        typed = Options(prefix, f"{self.kind} {name!r}", options).read(component.options)
        missing = [o.name for o in component.options if o.default is REQUIRED and o.name not in typed]
        if missing:
            raise OptionError(f"{prefix}{missing[0]}: required by {self.kind} {name!r}")
        problem = component.check({**component.defaults(), **typed}) if component.check else None
        if problem:
            raise OptionError(f"{prefix.rstrip('.')}: {problem}")
        return typed

    def build(self, name: str, options: Mapping[str, Any]) -> Any:
        """The component ``name`` (a name or a resolved path) built with validated ``options``."""
        return self[name](**options)


ALGORITHMS = Registry("algorithm", "fedpart.common.ml.algorithms",
                      "What is federated, trained and kept: `algorithm.name` and its options.", BY_COMPONENT)
TERMS = Registry("objective term", "fedpart.common.ml.objectives",
                 "A piece of the local loss, added to any algorithm by `algorithm.objective: {term: {options}}`.")
STEP_RULES = Registry("step rule", "fedpart.common.ml.objectives",
                      "How a local step updates the parameters; an algorithm brings its own, and its options are "
                      "the algorithm's (`algorithm.<option>`).")
CODECS = Registry("codec", "fedpart.common.wire.codecs",
                  "How a tensor travels: `compression.up.codec` and `compression.down.codec` with their options.",
                  BY_COMPONENT, "the receiver builds its decoder from the defaults (a payload carries what decoding "
                                "needs in its codec_args, the codec's wire_args)")
SERVER_OPTIMIZERS = Registry(
    "server optimizer", "fedpart.common.components.server_parts",
    "The server step over a round's combined delta: `server_optimizer.name` and its options.", BY_COMPONENT,
    capabilities={"needs_result_norms": "its step reads each result's delta norm (RoundDelta.second_moment)",
                  "needs_result_counts": "its step reads how many results sent each tensor (RoundDelta.results)"})
ROBUST_AGGREGATORS = Registry(
    "robust aggregator", "fedpart.common.components.server_parts",
    "How a round's deltas are combined: `robust.aggregator`; its options are keys of the `robust` section of the "
    "same name.", BY_COMPONENT,
    capabilities={"linear": "it combines the deltas as their weighted mean, a sum that a sum of masked or noised "
                            "updates can stand in for"})
PARTITIONS = Registry("partition scheme", "fedpart.common.data.partition",
                      "How the dataset is split over the clients: `data.partition.scheme` and its options.")
MODELS = Registry("model", "fedpart.common.models.zoo",
                  "The model, cut into body units and a head: `model.name` and its options.", BY_FUNCTION)
DATASETS = Registry("dataset", "fedpart.common.data.datasets",
                    "The data a run trains on: `data.dataset` and its options (`data.options`).", BY_FUNCTION)
