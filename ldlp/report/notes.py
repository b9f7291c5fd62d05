"""The notes that several pages share: the prompts dropped for length and the malformed records skipped after a
prompt count, the learned files of another setup that a run accepted, and the verdict line of the best adaptive
contender."""

from __future__ import annotations


def skipped_note(result: dict) -> str:
    """``, N malformed records skipped (...)`` after a page's prompt count (beside ``dropped_note``) when the run read
    its prompt file with ``data.on_error=skip`` and skipped any (``n_skipped_records``); empty otherwise."""
    k = int(result.get("n_skipped_records") or 0)
    return (f", **{k} malformed record{'s' if k != 1 else ''} of the prompt file skipped** (data.on_error=skip; the "
            "log names the first)") if k else ""


def mismatch_lines(result: dict) -> list[str]:
    """A page's lines for the learned files made for another setup that ``accept_mismatch=true`` let drive the run
    (``accepted_mismatches``, eagle_backbone/errors.py), each its message; none when it accepted none."""
    return [f"**Accepted mismatch** (accept_mismatch=true): {m}" for m in result.get("accepted_mismatches") or []]


def with_mismatch_lines(md: str, result: dict) -> str:
    """A page ``md`` with :func:`mismatch_lines` below its title (first line), those it does not show already."""
    lines = [line for line in mismatch_lines(result) if line not in md]
    if not lines:
        return md
    title, _, rest = md.partition("\n")
    return "\n\n".join([title, *lines]) + ("\n" + rest if rest.startswith("\n") else "\n\n" + rest)


def dropped_note(result: dict) -> str:
    """`` (N dropped: why)`` after a table's prompt count; in bold with the share when above 5%."""
    dropped, n = result.get("n_dropped"), result.get("n_prompts") or 0
    if dropped is None:
        return " (dropped prompts not recorded)"
    if not dropped:
        return ", none dropped"
    why = result.get("dropped_reason") or "reason not recorded"
    share = dropped / (n + dropped)
    return (f" (**{dropped} of {n + dropped} prompts ({100 * share:.0f}%) dropped: {why}**)" if share > 0.05
            else f" ({dropped} dropped: {why})")


def verdict_line(result: dict, ref: str, what: str) -> str:
    lo, hi = result["adaptive_gain_ci95"]
    word = "faster than" if lo > 0 else "slower than" if hi < 0 else "not distinguishable from"
    return (f"- {what}: **{result['best_adaptive']}**, {100 * result['adaptive_gain']:+.1f}% vs {ref} "
            f"(95% interval {100 * lo:+.1f}% to {100 * hi:+.1f}%): {word} the best static γ")
