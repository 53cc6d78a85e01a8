"""Greedy generation of many prompts at once: left-padded batches under a token budget.

One ``generate`` call per batch instead of per prompt: each decoding step's fixed cost (Python,
kernel launches, with ZeRO-3 a gather of every layer) is paid once for the batch. Prompts are
sorted longest first and grouped while the padded batch (rows x (longest prompt + new tokens))
stays within ``budget`` tokens; a prompt longer than the budget goes alone. Rows are padded on the
left with an attention mask, so each row's positions and attention are its own (transformers builds
position ids from the mask): the same answers as one prompt at a time, up to the rounding of a
batched matmul.
"""

from __future__ import annotations

import torch


def batches(lengths: list[int], budget: int, new_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped longest first, each group's rows x (its longest + ``new_tokens``)
    within ``budget`` (0: one index per group)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and budget > 0 and (len(groups[-1]) + 1) * (lengths[groups[-1][0]] + new_tokens) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask), both [rows, longest], each prompt right-aligned."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, longest - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, longest - len(p):] = 1
    return ids, mask


def until_end(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first end-of-sequence token (generate pads finished rows after it)."""
    for k, t in enumerate(tokens):
        if t in eos:
            return tokens[: k + 1]
    return tokens


@torch.no_grad()
def generate_many(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, eos_id, budget: int = 0,
                  device: torch.device | str = "cpu", synced: bool = False, calls: int = 0,
                  **sampling) -> list[list[int]]:
    """Each prompt's new token ids (greedy unless ``sampling`` says otherwise), ending at its first
    end-of-sequence token. ``eos_id``: an id, a list of ids, or None. ``synced``: ``synced_gpus``
    (ZeRO-3 partitioned weights: a collective per step); then every rank must make the same number of
    ``generate`` calls: ``calls`` (the most :func:`batches` of any rank; the extra ones repeat the first
    batch, their answers unused; a rank without prompts needs a dummy prompt to repeat)."""
    eos = set(eos_id if isinstance(eos_id, list) else [] if eos_id is None else [eos_id])
    out: list[list[int]] = [[] for _ in prompts]
    groups = batches([len(p) for p in prompts], budget, max_new_tokens)
    for k in range(max(len(groups), calls)):
        group = groups[k] if k < len(groups) else groups[0]
        ids, mask = left_padded([prompts[i] for i in group], pad_id)
        kw = {"do_sample": False, **sampling}
        result = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                max_new_tokens=max_new_tokens, use_cache=True, pad_token_id=pad_id,
                                eos_token_id=eos_id, synced_gpus=synced, **kw)
        if k < len(groups):
            for row, i in enumerate(group):
                out[i] = until_end(result[row, ids.shape[1]:].tolist(), eos)
    return out
