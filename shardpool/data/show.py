"""The first rows of each dataset as the model sees them, for ``shardpool validate --show N``.

A shown row is the text the tokenizer is given, the character spans of that text whose tokens are
trained, and the token count. The ids and labels are the ones training makes
(:func:`shardpool.data.prepare.samples_per_dataset`); this module only finds which characters each
token came from, by tokenizing the same pieces of text with the tokenizer's offset mapping:

* alpaca: the prompt and the response, tokenized apart as :mod:`shardpool.data.tokenizing` does;
* completion: the text;
* chat: the conversation rendered through its chat template, tokenized as a whole as
  :mod:`shardpool.data.chat` does;
* pre-tokenized rows have no text: it is the ids decoded;
* a preference pair (``rl``): two sequences, chosen then rejected, each the text TRL's DPOTrainer
  tokenizes as a whole: the prompt and the answer, with the eos it appends
  (:mod:`shardpool.data.preference`, :func:`shardpool.data.prepare.preference_pairs`).

The bos and eos that shardpool adds as ids around an alpaca or completion row, and the special
tokens the tokenizer itself adds around a preference sequence (a bos), are written out as their
token text (``<s>``, ``</s>``), so an eos that is trained shows as trained. A token past
``sequence_len`` is never trained (it is cut off). The ids found this way must equal the training
ids, or the row is refused in one line, so the spans never describe other tokens than training's.
"""

from __future__ import annotations

from dataclasses import dataclass
from os.path import commonprefix
from typing import Any

from shardpool.config import Config, DatasetSpec
from shardpool.data.conversations import chat_settings, conversation
from shardpool.data.formats import alpaca_texts, completion_texts
from shardpool.data.preference import with_eos
from shardpool.data.prepare import preference_rows
from shardpool.data.reading import read_rows
from shardpool.data.rows import IGNORE_INDEX, Sample
from shardpool.data.tokenizing import dataset_chat_template
from shardpool.errors import ShardpoolError

__all__ = ["OPENING", "CLOSING", "ShownRow", "dataset_kind", "marked_text", "shown_pairs", "shown_rows"]

#: What surrounds trained text where colour cannot show it (a pipe, a file, NO_COLOR).
OPENING, CLOSING = "⟦", "⟧"

Span = tuple[int, int]
#: A preference row's two training sequences: (chosen, rejected).
Pair = tuple[Sample, Sample]


@dataclass(frozen=True)
class ShownRow:
    """One row as the model sees it: ``text``, its trained character spans ``[start, end)``, its tokens.

    ``dataset`` is the index in ``datasets``, ``row`` counts from 1 within it, ``where`` names the
    file and line. ``seen`` is how many characters of ``text`` lie within ``sequence_len`` (all of
    them unless the row is cut). ``pair`` is ``"chosen"`` or ``"rejected"`` for a sequence of a
    preference pair, None for a supervised row.
    """

    dataset: int
    row: int
    where: str
    kind: str
    text: str
    trained: tuple[Span, ...]
    tokens: int
    trained_tokens: int
    seen: int
    pair: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON line ``validate --show N --json`` prints for this row (``pair`` only for a pair's)."""
        line: dict[str, Any] = {
            "dataset": self.dataset,
            "row": self.row,
            "text": self.text,
            "trained": [list(span) for span in self.trained],
            "tokens": self.tokens,
        }
        if self.pair is not None:
            line["pair"] = self.pair
        return line


def dataset_kind(spec: DatasetSpec) -> str:
    """How a dataset's ``type`` is named in validate's output; a ``type`` mapping is axolotl's user_defined.default."""
    if isinstance(spec.type, dict):
        return "user_defined.default"
    return spec.type or "pre-tokenized"


def shown_rows(config: Config, tokenizer: Any, per_dataset: list[list[Sample]], count: int) -> list[ShownRow]:
    """The first ``count`` rows of every dataset of ``config``, given the samples training made of them.

    ``tokenizer`` must be fast (it gives offset mappings) and configured as training configures it.
    """
    shown: list[ShownRow] = []
    for index, (spec, samples) in enumerate(zip(config.datasets, per_dataset, strict=True)):
        first = samples[:count]
        located = _locate(config, spec, index, tokenizer, first)
        for number, (sample, (text, offsets)) in enumerate(zip(first, located, strict=True), start=1):
            shown.append(_shown_row(index, number, spec, sample, text, offsets, config.sequence_len))
    return shown


def shown_pairs(config: Config, tokenizer: Any, per_dataset: list[list[Pair]], count: int) -> list[ShownRow]:
    """The first ``count`` pairs of every preference dataset of ``config``, given the pairs training made
    (:func:`shardpool.data.prepare.preference_pairs`): each pair as its chosen sequence, then its rejected one.

    A pair's ``row`` is its row's number in the dataset, left-out rows counted, so it names the
    row the file holds. ``tokenizer`` must be fast and configured as training configures it.
    """
    shown: list[ShownRow] = []
    for index, (spec, pairs) in enumerate(zip(config.datasets, per_dataset, strict=True)):
        if not pairs[:count]:
            continue
        rows = preference_rows(config, spec, index, tokenizer)
        numbers = {where: number for number, (where, _) in enumerate(rows, start=1)}
        texts = dict(rows)
        for chosen, rejected in pairs[:count]:
            row = texts[chosen.where]
            for name, sample, answer in (
                ("chosen", chosen, row.chosen),
                ("rejected", rejected, row.rejected),
            ):
                text, offsets = _whole(tokenizer, sample, row.prompt + with_eos(answer, tokenizer.eos_token))
                number = numbers[sample.where]
                shown.append(
                    _shown_row(index, number, spec, sample, text, offsets, config.sequence_len, pair=name)
                )
    return shown


def marked_text(row: ShownRow, opening: str = OPENING, closing: str = CLOSING) -> str:
    """The part of ``row.text`` the model sees, each trained span between ``opening`` and ``closing``."""
    pieces: list[str] = []
    done = 0
    for start, end in row.trained:
        pieces += [row.text[done:start], opening, row.text[start:end], closing]
        done = end
    pieces.append(row.text[done : row.seen])
    return "".join(pieces)


def _shown_row(
    index: int,
    number: int,
    spec: DatasetSpec,
    sample: Sample,
    text: str,
    offsets: list[Span],
    sequence_len: int,
    *,
    pair: str | None = None,
) -> ShownRow:
    """The row whose tokens lie at ``offsets`` of ``text``; ``sample`` may already be cut to ``sequence_len``."""
    kept = min(len(offsets), sequence_len)
    trained = [position for position in range(kept) if sample.labels[position] != IGNORE_INDEX]
    return ShownRow(
        dataset=index,
        row=number,
        where=sample.where,
        kind=dataset_kind(spec),
        text=text,
        trained=tuple(_spans(trained, offsets)),
        tokens=len(offsets),
        trained_tokens=len(trained),
        seen=len(text) if kept == len(offsets) else max(end for _, end in offsets[:kept]),
        pair=pair,
    )


def _spans(positions: list[int], offsets: list[Span]) -> list[Span]:
    """The character spans of the tokens at ``positions``; neighbouring tokens make one span.

    Two trained tokens in a row share a span even where the offsets leave out the whitespace
    between them (tokenizers that trim offsets), since those characters came with the tokens.
    """
    spans: list[list[int]] = []
    previous = -2
    for position in positions:
        start, end = offsets[position]
        follows, previous = position == previous + 1, position
        if start >= end:  # a token with no characters of its own
            continue
        if spans and (follows or start <= spans[-1][1]):
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [(start, end) for start, end in spans]


def _locate(
    config: Config, spec: DatasetSpec, index: int, tokenizer: Any, samples: list[Sample]
) -> list[tuple[str, list[Span]]]:
    """The text of each sample and each of its tokens' character span in that text."""
    if not samples:
        return []
    if spec.type is None:
        return [_decoded(tokenizer, sample, config.sequence_len) for sample in samples]
    rows = read_rows(spec, index)[: len(samples)]
    if spec.is_chat:
        template = dataset_chat_template(spec, tokenizer, config.chat_template, config.chat_template_jinja)
        settings = chat_settings(spec)
        texts = [
            tokenizer.apply_chat_template(
                conversation(row, where, settings), chat_template=template, tokenize=False
            )
            for where, row in rows
        ]
        return [
            _joined(tokenizer, sample, [text], ends=False)
            for sample, text in zip(samples, texts, strict=True)
        ]
    if spec.type == "alpaca":
        prompts, responses = alpaca_texts(rows)
        pieces = [[prompt, response] for prompt, response in zip(prompts, responses, strict=True)]
    else:
        pieces = [[text] for text in completion_texts(rows, spec.field or "text")]
    return [
        _joined(tokenizer, sample, texts, ends=True) for sample, texts in zip(samples, pieces, strict=True)
    ]


def _joined(tokenizer: Any, sample: Sample, texts: list[str], *, ends: bool) -> tuple[str, list[Span]]:
    """``texts`` tokenized apart and joined, as training joins them; ``ends``: bos (if any) and eos around.

    The special tokens around are written out as their token text. Refused in one line when the
    ids differ from the sample's.
    """
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    body = [token for ids in encoded["input_ids"] for token in ids]
    head_length = len(sample.input_ids) - len(body) - 1 if ends else 0  # 1 with bos, else 0
    head = sample.input_ids[: max(head_length, 0)]
    tail = sample.input_ids[-1:] if ends else []
    if head_length not in (0, 1) or head + body + tail != sample.input_ids:
        raise _not_the_training_ids(sample, "row")
    return _spelled(tokenizer, head, texts, encoded["offset_mapping"], tail)


def _whole(tokenizer: Any, sample: Sample, text: str) -> tuple[str, list[Span]]:
    """``text`` tokenized as a whole with the tokenizer's special tokens, as TRL tokenizes a prompt and
    its answer; the special tokens the tokenizer adds (a bos) are written out as their token text.

    Refused in one line when the ids, cut to the sample's length (``sequence_len``), differ from the sample's.
    """
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    body, ids = encoded["input_ids"], tokenizer(text)["input_ids"]
    start = next((i for i in range(len(ids) - len(body) + 1) if ids[i : i + len(body)] == body), None)
    if start is None or ids[: len(sample.input_ids)] != sample.input_ids:
        raise _not_the_training_ids(sample, "pair")
    return _spelled(tokenizer, ids[:start], [text], [encoded["offset_mapping"]], ids[start + len(body) :])


def _spelled(
    tokenizer: Any, head: list[int], texts: list[str], offsets: list[list[Span]], tail: list[int]
) -> tuple[str, list[Span]]:
    """The special tokens ``head``, the ``texts`` (whose tokens lie at ``offsets``), then ``tail``,
    joined into one text; each token's span in it."""
    text, joined = _appended_tokens(tokenizer, head, "", [])
    for piece, piece_offsets in zip(texts, offsets, strict=True):
        joined += [(len(text) + start, len(text) + end) for start, end in piece_offsets]
        text += piece
    return _appended_tokens(tokenizer, tail, text, joined)


def _not_the_training_ids(sample: Sample, what: str) -> ShardpoolError:
    """The one line refusing to show a ``what`` ("row", "pair") whose text gives other ids than training's."""
    return ShardpoolError(
        f"{sample.where}: cannot show this {what}: its text does not tokenize to the ids training "
        "uses; report this as a bug, with the row and the tokenizer"
    )


def _appended_tokens(
    tokenizer: Any, ids: list[int], text: str, offsets: list[Span]
) -> tuple[str, list[Span]]:
    """``text`` and ``offsets`` with each of ``ids`` (special tokens) written out after them."""
    for token in ids:
        written = tokenizer.decode([token], skip_special_tokens=False)
        offsets = [*offsets, (len(text), len(text) + len(written))]
        text += written
    return text, offsets


def _decoded(tokenizer: Any, sample: Sample, sequence_len: int) -> tuple[str, list[Span]]:
    """A pre-tokenized row's ids decoded, and where each token lies in that text.

    The ids are cut into runs where training starts or stops (a label becomes or stops being -100,
    or ``sequence_len`` is reached); a run's text starts where the decoding of the ids before it
    ends, and each of its tokens is given the whole run (the span of a lone token cannot be told
    from its decoding alone).
    """
    ids = sample.input_ids
    text = tokenizer.decode(ids, skip_special_tokens=False)
    trained = [
        position < sequence_len and label != IGNORE_INDEX for position, label in enumerate(sample.labels)
    ]
    cuts = [p for p in range(1, len(ids)) if trained[p] != trained[p - 1] or p == sequence_len]
    ends = [len(commonprefix([tokenizer.decode(ids[:cut], skip_special_tokens=False), text])) for cut in cuts]
    offsets: list[Span] = []
    for begin, finish, start, end in zip(
        [0, *cuts], [*cuts, len(ids)], [0, *ends], [*ends, len(text)], strict=True
    ):
        offsets += [(start, end)] * (finish - begin)
    return text, offsets
