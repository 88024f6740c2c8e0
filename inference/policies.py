"""A drifting policy: the sequence of checkpoints an RL run samples from, one per epoch, and the
problems it is trained on, as ``policies.json`` describes them.

    {"format": "draftlab-policies/1",
     "policies": ["default", "policy-001", ...],   # epoch e samples from entry e
     "problems": [{"id", "task", "question", "answer", "params"}, ...],
     "made_by": {...}}                             # how they were made (free-form)

An entry is a directory relative to the manifest (an HF model directory: config.json,
safetensors weights and the tokenizer), else any target spec :meth:`Target.load` takes (the
first entry is usually the base target, ``default``). Every policy must read and write text as
the first one does: the same vocabulary, end-of-sequence token and chat template, checked before
any model loads, so that one prompt is one token sequence all run long.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from draftlab.errors import DraftlabError
from draftlab.inference.rollout_tasks import Problem, problem_from_dict

FORMAT = "draftlab-policies/1"
MANIFEST = "policies.json"


@dataclass
class PolicySequence:
    path: Path  # the manifest
    entries: list[str]
    problems: list[Problem]
    made_by: dict

    @classmethod
    def read(cls, where) -> "PolicySequence":
        """The manifest at ``where`` (the file, or a directory holding ``policies.json``)."""
        from draftlab.atomic import reason

        path = Path(where)
        path = path / MANIFEST if path.is_dir() else path
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise DraftlabError(f"policies {path}: cannot read ({reason(e)})") from None
        except ValueError as e:
            raise DraftlabError(f"policies {path}: not valid JSON ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise DraftlabError(f"policies {path}: not a {FORMAT} manifest")
        entries, problems = data.get("policies"), data.get("problems")
        if not isinstance(entries, list) or not entries or not all(isinstance(e, str) and e for e in entries):
            raise DraftlabError(f"policies {path}: 'policies' must be a non-empty list of checkpoint paths")
        try:
            probs = [problem_from_dict(p) for p in problems]
        except (TypeError, KeyError):
            raise DraftlabError(f"policies {path}: 'problems' must be a list of problems as make-policies writes them") from None
        if not probs:
            raise DraftlabError(f"policies {path}: holds no problems")
        return cls(path, entries, probs, data.get("made_by") or {})

    def location(self, i: int) -> str:
        """Entry ``i`` as a target spec: its directory beside the manifest, else the entry itself."""
        local = self.path.parent / self.entries[i]
        return str(local) if local.is_dir() else self.entries[i]

    def check(self) -> None:
        """Every policy reads text as the first one does (one-line error naming the first that does not)."""
        first = _text_interface(self.location(0), self.entries[0])
        for i in range(1, len(self.entries)):
            other = _text_interface(self.location(i), self.entries[i])
            for what in ("vocabulary", "end-of-sequence token", "chat template"):
                if other[what] != first[what]:
                    detail = f" ({len(other[what])} tokens vs {len(first[what])})" if what == "vocabulary" else ""
                    raise DraftlabError(f"policy {i} ({self.entries[i]}): its tokenizer's {what} differs from "
                                        f"policy 0's ({self.entries[0]}){detail}; a policy sequence must share one tokenizer")

    def load(self, i: int):
        """Policy ``i`` as a :class:`~draftlab.models.target.Target` (fp32)."""
        from draftlab.models.target import Target

        return Target.load(self.location(i), dtype="float32")


def _text_interface(spec: str, entry: str) -> dict:
    from transformers import AutoTokenizer

    from draftlab.models.target import resolve_target

    path, _ = resolve_target(spec)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise DraftlabError(f"policy {entry}: cannot load its tokenizer ({' '.join(str(e).splitlines())[:200]})") from None
    return {"vocabulary": tok.get_vocab(), "end-of-sequence token": tok.eos_token_id, "chat template": tok.chat_template}


def write_manifest(out: Path, entries: list[str], problems: list[Problem], made_by: dict) -> Path:
    from draftlab.atomic import write_text

    path = Path(out) / MANIFEST
    write_text(path, json.dumps({"format": FORMAT, "policies": entries, "problems": [p.to_dict() for p in problems],
                                 "made_by": made_by}, indent=2) + "\n")
    return path
