"""The drafter kinds, by name: one class each (a :class:`~eagle_backbone.candidates.CandidateGenerator`), in one file
each, as vLLM has one proposer per speculative method.

A kind's class loads its weights and checks that they fit the target (:meth:`~CandidateGenerator.load`,
:meth:`~CandidateGenerator.check_fits`), drafts (the generator's calls), gives the step-cost profiler its forwards
(:meth:`~CandidateGenerator.profile_feed` and the like) and says which label collections label it
(``labelled_by``, ``oracle_rows``). Every place that acts on ``model.drafter_kind`` looks the kind up here.

The shipped kinds are the modules of :mod:`eagle_backbone.kinds`, each registering its class with
:func:`register`; the first lookup imports them all, so a module added there is found without a list to edit. A
kind defined elsewhere (a test, a plugin) registers itself the same way and is found once its module is imported.
The registry imports the kinds by name at run time, and they import the core: the core never imports them.
"""

from __future__ import annotations

import importlib
import pkgutil

from eagle_backbone.candidates import CandidateGenerator

PACKAGE = "eagle_backbone.kinds"  # every module of this package is a drafter kind

_KINDS: dict[str, type[CandidateGenerator]] = {}
_found = False


def register(cls: type[CandidateGenerator]) -> type[CandidateGenerator]:
    """Class decorator: register ``cls`` under its ``kind``. A second class under a name already taken is refused
    (the same class again, as a module re-imported, replaces it)."""
    if not (isinstance(cls, type) and issubclass(cls, CandidateGenerator)):
        raise TypeError(f"a drafter kind is a CandidateGenerator subclass, got {cls!r}")
    name = cls.kind
    if not isinstance(name, str) or not name or name == CandidateGenerator.kind:
        raise ValueError(f"{cls.__name__}: a drafter kind needs a name of its own (its class attribute kind)")
    old = _KINDS.get(name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"drafter kind {name!r} is registered already ({old.__module__}.{old.__qualname__})")
    _KINDS[name] = cls
    return cls


def unregister(name: str) -> None:
    """Drop a kind (a test's own, after it)."""
    _KINDS.pop(name, None)


def _discover() -> None:
    """Import every module of :data:`PACKAGE` once: each registers its kind."""
    global _found
    if _found:
        return
    package = importlib.import_module(PACKAGE)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{PACKAGE}.{info.name}")
    _found = True


def kind_names() -> list[str]:
    """The registered kinds' names, sorted."""
    _discover()
    return sorted(_KINDS)


def get_kind(name) -> type[CandidateGenerator]:
    """The class of drafter kind ``name``; an unknown name is one line listing the registered ones."""
    _discover()
    cls = _KINDS.get(str(name)) if name is not None else None
    if cls is None:
        raise ValueError(f"model.drafter_kind must be a registered drafter kind ({', '.join(map(repr, kind_names()))}), "
                         f"got {name!r}")
    return cls


def kinds_labelled_by(collection: str) -> list[str]:
    """The registered kinds a label collection (``oracle``, ``acceptance``) labels."""
    return [n for n in kind_names() if collection in _KINDS[n].labelled_by]


def make_candidates(kind: str, drafter, target, attn: str = "eager") -> CandidateGenerator:
    """The candidate generator of kind ``kind`` for a drafter model (what its :meth:`~CandidateGenerator.load`
    returns) and the target."""
    return get_kind(kind)(drafter, target, attn)
