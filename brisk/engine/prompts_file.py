"""Prompt files, one format for every command that takes `--prompts-file` of prompts to answer
(`brisk generate`, `brisk train-heads`): one prompt a line, or a JSON object a line with "prompt"
(text, which may hold line breaks) or "messages" (a conversation). Blank lines are skipped."""

from __future__ import annotations

import json
from pathlib import Path

from brisk.errors import UserError


def read_prompts_file(path: Path) -> list[tuple[int, dict[str, object]]]:
    """(line number, item) for every prompt line: {"prompt": the line} for a plain line, the
    object itself for a JSON line; UserError naming the file and line for anything else."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read --prompts-file {path}: {exc.strerror}") from None
    items: list[tuple[int, dict[str, object]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            items.append((number, {"prompt": line}))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not ({"prompt", "messages"} & obj.keys()):
            raise UserError(f"{path}:{number}: a JSON line needs a 'prompt' or 'messages' field")
        if "messages" not in obj and not isinstance(obj["prompt"], str):
            raise UserError(f"{path}:{number}: 'prompt' must be a string")
        items.append((number, obj))
    if not items:
        raise UserError(f"--prompts-file {path} has no prompts")
    return items
