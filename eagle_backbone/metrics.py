"""Per-generation counters and their sums over a prompt set."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class GenerationStats:
    new_tokens: int = 0
    wall_s: float = 0.0
    target_forwards: int = 0  # prefill included: it emits the first token
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # drafted tokens the target kept
    draft_s: float = 0.0  # in the candidate generator (policy callbacks excluded)
    target_s: float = 0.0  # target forwards and verification
    policy_s: float = 0.0  # choosing γ and early-stop decisions
    accept_lengths: list[int] = field(default_factory=list)  # accepted drafts per step
    draft_lengths: list[int] = field(default_factory=list)  # drafted tokens per step

    @property
    def wasted_tokens(self) -> int:
        return self.drafted_tokens - self.accepted_tokens

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward, bonus token included (EAGLE's and Spec-Bench's τ)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def reached_and_kept(self, depth: int) -> tuple[list[int], list[int]]:
        """Per draft depth k = 1..``depth``: the steps whose k-th draft the target scored with every draft before
        it kept (reached), and those that kept it too; kept / reached is the chain's acceptance at depth k."""
        reached, kept = [0] * depth, [0] * depth
        for drafted, accepted in zip(self.draft_lengths, self.accept_lengths):
            for k in range(min(drafted, accepted + 1, depth)):
                reached[k] += 1
                kept[k] += k < accepted
        return reached, kept

    def record_step(self, drafted: int, accepted: int) -> None:
        """One verification: ``drafted`` drafts scored, ``accepted`` of them kept."""
        self.target_forwards += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.draft_lengths.append(drafted)
        self.accept_lengths.append(accepted)

    def uncount_accepted(self, n: int) -> None:
        """The last step's ``n`` kept drafts were never emitted (past an EOS or the budget): waste."""
        if n:
            self.accepted_tokens -= n
            self.accept_lengths[-1] -= n

    def __add__(self, other: "GenerationStats") -> "GenerationStats":
        out = GenerationStats()
        for f in fields(self):
            setattr(out, f.name, getattr(self, f.name) + getattr(other, f.name))
        return out

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not isinstance(v, list)}
        d.update(wasted_tokens=self.wasted_tokens, tokens_per_s=self.tokens_per_s, tau=self.tau,
                 acceptance_rate=self.acceptance_rate)
        return d


def total(stats: list[GenerationStats]) -> GenerationStats:
    return sum(stats, GenerationStats())
