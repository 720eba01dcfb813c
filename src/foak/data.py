"""Datasets for ``foak train``: JSONL loading with line-numbered errors, tokenisation (response-only labels
for prompt/response pairs), truncation, padding-free packing, and the embedded default (a character
tokenizer and a generated, learnable corpus: no downloads)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE_INDEX = -100


class DatasetError(ValueError):
    """A problem with the training data, reported before training starts."""


# ---- reading ------------------------------------------------------------------------------------------
def read_jsonl(path: str | Path, text_field: str = "text") -> list[dict]:
    """Records of a JSONL file: each line an object with ``text_field``, or with "prompt" and "response"."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    records, problems = [], []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"line {number}: not valid JSON ({e.msg} at column {e.colno})")
                continue
            problem = _record_problem(record, text_field)
            if problem:
                problems.append(f"line {number}: {problem}")
            else:
                records.append(record)
    if problems:
        shown = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise DatasetError(f"{path}: {len(problems)} malformed line(s):\n  {shown}{more}")
    if not records:
        raise DatasetError(f"{path}: the dataset is empty (no JSON lines)")
    return records


def _record_problem(record, text_field: str) -> str | None:
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    if "prompt" in record or "response" in record:
        for key in ("prompt", "response"):
            if not isinstance(record.get(key), str):
                return f"a prompt/response record needs string fields 'prompt' and 'response' (missing or not a string: {key!r})"
        if not record["response"]:
            return "empty 'response': nothing to train on"
        return None
    if not isinstance(record.get(text_field), str):
        return f"expected a string field {text_field!r} (or 'prompt' and 'response'); keys present: {sorted(record)}"
    if not record[text_field].strip():
        return f"empty {text_field!r}"
    return None


# ---- tokenising ---------------------------------------------------------------------------------------
@dataclass
class TokenizedDataset(torch.utils.data.Dataset):
    examples: list[dict]
    truncated: int = 0

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]

    @property
    def n_tokens(self) -> int:
        return sum(len(e["input_ids"]) for e in self.examples)


def tokenize(records: list[dict], tokenizer, max_seq_length: int, text_field: str = "text") -> TokenizedDataset:
    """input_ids and labels per record. Prompt tokens get label -100 (trained on the response only).
    Sequences longer than max_seq_length are truncated (their count is reported)."""
    if max_seq_length < 2:
        raise DatasetError(f"max_seq_length must be >= 2, got {max_seq_length}")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    examples, truncated = [], 0
    for record in records:
        if "prompt" in record:
            prompt = bos + tokenizer.encode(record["prompt"], add_special_tokens=False)
            response = tokenizer.encode(record["response"], add_special_tokens=False) + eos
            ids = prompt + response
            labels = [IGNORE_INDEX] * len(prompt) + response
        else:
            ids = bos + tokenizer.encode(record[text_field], add_special_tokens=False) + eos
            labels = list(ids)
        if len(ids) > max_seq_length:
            ids, labels = ids[:max_seq_length], labels[:max_seq_length]
            truncated += 1
        if all(label == IGNORE_INDEX for label in labels[1:]):
            continue  # a prompt that fills the whole window leaves nothing to learn
        examples.append({"input_ids": ids, "labels": labels})
    if not examples:
        raise DatasetError(
            f"no trainable tokens: every example's response lies beyond max_seq_length={max_seq_length}"
        )
    return TokenizedDataset(examples, truncated)


# ---- batching -----------------------------------------------------------------------------------------
class PackingCollator:
    """Padding-free packing: the batch's sequences concatenated into one row, position_ids restarting at
    each sequence, the first label of each sequence ignored. transformers keeps attention within each
    sequence only when the position_ids restart, there is no attention_mask and no KV cache: the batch
    therefore carries use_cache=False (with a cache the sequences would silently attend to each other)."""

    def __call__(self, features):
        ids, labels, positions = [], [], []
        for f in features:
            ids += f["input_ids"]
            labels += [IGNORE_INDEX] + f["labels"][1:]
            positions += list(range(len(f["input_ids"])))
        as_row = lambda values: torch.tensor([values], dtype=torch.long)
        return {"input_ids": as_row(ids), "labels": as_row(labels), "position_ids": as_row(positions),
                "use_cache": False}


class PaddingCollator:
    """Right padding to the longest sequence of the batch; padded labels are -100."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features):
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        for row, f in enumerate(features):
            n = len(f["input_ids"])
            ids[row, :n] = torch.tensor(f["input_ids"])
            labels[row, :n] = torch.tensor(f["labels"])
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ---- the embedded default -----------------------------------------------------------------------------
DEFAULT_CHARS = "abcdefghijklmnopqrstuvwxyz .,'?!0123456789\n"


def char_tokenizer():
    """A character-level tokenizer built locally (PreTrainedTokenizerFast; save_pretrained works)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(DEFAULT_CHARS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # every character
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher", "our team"]
_VERBS = ["sees", "likes", "finds", "helps", "follows", "calls", "watches"]
_OBJECTS = ["the ball", "a red box", "the river", "two apples", "the green door", "a long road"]
_PLACES = ["in the park", "at home", "near the sea", "after school", "every morning", "on the hill"]


def generated_corpus(n: int = 2000, seed: int = 0) -> list[dict]:
    """Sentences from a small grammar plus counting lines: structured enough that a tiny model's loss
    falls clearly within a minute of CPU training."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        if i % 4 == 3:
            start = rng.randrange(0, 80)
            text = " ".join(str(start + k) for k in range(8)) + "."
        else:
            text = (f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                    f"{rng.choice(_PLACES)}.")
        records.append({"text": text})
    return records
