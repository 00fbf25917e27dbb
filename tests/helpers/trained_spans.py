"""Checking `validate --show` rows against the tokens training makes, independently of how spans are found.

A shown row says which characters of its text are trained. The check decodes the training ids
themselves: the trained tokens (labels != -100 within sequence_len), decoded run by run, must spell
the text inside the spans, and the other tokens the model sees must spell the text outside them.
Whitespace is left out of both sides, because decoding a run of tokens apart from its neighbours
may drop or add a leading space (sentencepiece) and the offsets of a token may leave out the space
it starts with.
"""

from __future__ import annotations

from typing import Any

from shardpool.data.rows import IGNORE_INDEX, Sample


def _runs(positions: list[int]) -> list[list[int]]:
    """Consecutive positions grouped: [1, 2, 5] -> [[1, 2], [5]]."""
    runs: list[list[int]] = []
    for position in positions:
        if runs and position == runs[-1][-1] + 1:
            runs[-1].append(position)
        else:
            runs.append([position])
    return runs


def _squeezed(text: str) -> str:
    return "".join(text.split())


#: What a tokenizer decodes the first bytes of a character to, when the rest were cut off.
_PARTIAL = "\ufffd"


def check_shown_row(row: dict[str, Any], sample: Sample, tokenizer: Any, sequence_len: int) -> None:
    """Assert that ``row`` (a JSON line of `validate --show --json`) marks exactly ``sample``'s trained tokens."""
    text, spans = row["text"], [tuple(span) for span in row["trained"]]
    assert set(row) == {"dataset", "row", "text", "trained", "tokens"}
    assert row["tokens"] == len(sample.input_ids)
    assert all(0 <= start < end <= len(text) for start, end in spans), spans
    assert all(first[1] < second[0] for first, second in zip(spans, spans[1:], strict=False)), spans
    kept = min(len(sample.input_ids), sequence_len)
    trained = [p for p in range(kept) if sample.labels[p] != IGNORE_INDEX]
    untrained = [p for p in range(kept) if sample.labels[p] == IGNORE_INDEX]

    def decoded(positions: list[int]) -> str:
        return "".join(
            tokenizer.decode([sample.input_ids[p] for p in run], skip_special_tokens=False)
            for run in _runs(positions)
        )

    inside = "".join(text[start:end] for start, end in spans)
    seen = len(text) if kept == len(sample.input_ids) else None
    trained_text = decoded(trained)
    if seen is None and trained_text.endswith(_PARTIAL) and not inside.endswith(_PARTIAL):
        # sequence_len cut a character's bytes: the last kept token decodes to U+FFFD, while the
        # span, in whole characters, ends with that character
        trained_text, inside = trained_text[: -len(_PARTIAL)], inside[:-1]
    assert _squeezed(trained_text) == _squeezed(inside), (trained_text, inside)
    outside_parts, done = [], 0
    for start, end in spans:
        outside_parts.append(text[done:start])
        done = end
    outside_parts.append(text[done:seen])
    outside = "".join(outside_parts)
    if seen is None:  # cut by sequence_len: the untrained tokens seen spell a prefix of what is left
        untrained_text = decoded(untrained).removesuffix(_PARTIAL)  # a character cut by sequence_len
        assert _squeezed(outside).startswith(_squeezed(untrained_text)), (untrained_text, outside)
    else:
        assert _squeezed(decoded(untrained)) == _squeezed(outside), (decoded(untrained), outside)
