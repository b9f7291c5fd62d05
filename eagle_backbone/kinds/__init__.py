"""The drafter kinds: every module here is one kind, one :class:`~eagle_backbone.candidates.CandidateGenerator`
subclass registered by :func:`eagle_backbone.drafter_kinds.register` (``eagle``: EAGLE-1, ``eagle3``: EAGLE-3,
``draft_lm``: a standalone draft LM). :mod:`eagle_backbone.drafter_kinds` imports them all on its first lookup, so
adding a kind is adding a module here (and a ``conf/model/*.yaml`` naming it). They import the core; nothing in the
core imports them by name (docs/batched.md, "Adding a drafter kind")."""
