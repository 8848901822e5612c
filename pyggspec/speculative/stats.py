"""Speculation counts: drafted and accepted per draft position, draft lengths, evaluations.

One :class:`SpecStats` per request and one for the engine since start; the scheduler's
update is the one place that records into them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    n_drafted: int = 0
    n_accepted: int = 0
    n_steps: int = 0  # verify steps
    n_target_evals: int = 0  # target graph evaluations (verify + re-evaluation + prompt)
    n_mtp_evals: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)  # verify steps by draft length k

    def record(self, k: int, n: int) -> None:
        while len(self.drafted_at) < k:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        while len(self.draft_lengths) <= k:
            self.draft_lengths.append(0)
        self.draft_lengths[k] += 1
        for i in range(k):
            self.drafted_at[i] += 1
            if i < n:
                self.accepted_at[i] += 1
        self.n_drafted += k
        self.n_accepted += n
        self.n_steps += 1

    def merge(self, other: SpecStats) -> None:
        """Add ``other``'s counts (e.g. one request's) into these."""
        for name in ("drafted_at", "accepted_at", "draft_lengths"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
        self.n_drafted += other.n_drafted
        self.n_accepted += other.n_accepted
        self.n_steps += other.n_steps
        self.n_target_evals += other.n_target_evals
        self.n_mtp_evals += other.n_mtp_evals

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (1 + accepted drafts), llama.cpp's 'mean len'."""
        return 1 + self.n_accepted / self.n_steps if self.n_steps else 0.0

    def to_dict(self, spec_type: str = "draft-mtp") -> dict:
        return {"type": spec_type, "n_drafted": self.n_drafted, "n_accepted": self.n_accepted,
                "acceptance": self.acceptance, "per_position": self.per_position,
                "mean_accepted_length": self.mean_accepted_length, "n_steps": self.n_steps,
                "n_target_evals": self.n_target_evals, "n_mtp_evals": self.n_mtp_evals,
                "draft_lengths": list(self.draft_lengths)}
