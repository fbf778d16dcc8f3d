"""DPO: preference pairs as tokens, the sigmoid loss against the model with
its adapter disabled, and the held-out pairs' margin and accuracy.

A pair is two rows of one micro-batch: `PairTokens` answers pair i as rows
(prompt + chosen, prompt + rejected), a micro-batch's chosen rows first and
its rejected rows after, only the last assistant turn labelled. The
reference log-probabilities come from the same weights with the adapter
disabled (peft's `disable_adapter`): no second copy of the model, one extra
forward pass per micro-batch without gradients (lorafleet_trainer.memory
counts it). The loss of a pair (Rafailov et al. 2023, sigmoid form) is

    -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))

where pi and ref are the summed log-probabilities of an answer's tokens; its
rewards are beta * (pi - ref) of each answer, its margin their difference,
and it is "right" when the chosen answer's reward is the higher.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from lorafleet_trainer.batches import Batch, to_batch
from lorafleet_trainer.guard import pass_rows
from lorafleet_trainer.loop import Loop
from lorafleet_trainer.loss import answer_rows
from lorafleet_trainer.memory import chunk_rows
from lorafleet_trainer.params import Params
from lorafleet_trainer.protocol import TrainingFailureError
from lorafleet_trainer.records import Conversation, Preference
from lorafleet_trainer.rendering import Encoded, Tokens


def pair_rows(pairs: Sequence[tuple[int, Preference]]) -> list[tuple[int, Conversation]]:
    """The pairs as conversations, pair i at 2i (chosen) and 2i + 1 (rejected)."""
    return [(line, conv) for line, pair in pairs for conv in pair.conversations()]


class PairTokens(Tokens):
    """`Tokens` of `pair_rows`, indexed by pair: `get` answers a list of
    pairs' rows, the chosen ones first; `lengths` a pair's two rows' tokens
    together (0 when either has no answer token within max_seq_len)."""

    def get(self, indices: Sequence[int]) -> list[Encoded]:
        return super().get([2 * i for i in indices] + [2 * i + 1 for i in indices])

    def lengths(self, indices: Sequence[int]) -> list[int]:
        rows = super().get([r for i in indices for r in (2 * i, 2 * i + 1)])
        return [
            len(c.input_ids) + len(r.input_ids) if c.answer_tokens and r.answer_tokens else 0
            for c, r in zip(rows[::2], rows[1::2], strict=True)
        ]


def _chunk_logps(h: Any, weight: Any, targets: Any, softcap: float | None) -> Any:
    logits = (h @ weight.T).float()
    if softcap is not None:
        import torch

        logits = torch.tanh(logits / softcap) * softcap
    return logits.gather(1, targets[:, None])[:, 0] - logits.logsumexp(-1)


def sequence_logps(model: Any, batch: Batch) -> Any:
    """Each row's summed log-probability of its answer tokens (fp32, (rows,)).
    The logits live a chunk of `chunk_rows` at a time, recomputed in the
    backward pass (torch's checkpoint), as the supervised loss's."""
    import torch
    from torch.utils.checkpoint import checkpoint

    found = answer_rows(model, batch)
    targets = batch.answer_targets
    if not isinstance(found, tuple):
        token_logps = found.gather(1, targets[:, None])[:, 0] - found.logsumexp(-1)
    else:
        rows, weight, softcap = found
        step = chunk_rows(weight.shape[0])
        with torch.autocast(rows.device.type, enabled=False):
            token_logps = torch.cat([
                checkpoint(_chunk_logps, rows[s : s + step], weight, targets[s : s + step],
                           softcap, use_reentrant=False)
                for s in range(0, rows.shape[0], step)
            ])  # fmt: skip
    width = int(batch.input_ids.shape[1]) - 1
    row_of = batch.answer_positions // width
    out = torch.zeros(
        int(batch.input_ids.shape[0]), dtype=torch.float32, device=batch.input_ids.device
    )
    return out.index_add(0, row_of, token_logps.float())


def pair_parts(batch: Batch, pairs: int) -> list[Batch]:
    """`batch` (n pairs: chosen rows, then rejected rows) as forward passes of
    at most `pairs` pairs each, each part again chosen rows then rejected."""
    import torch

    n = int(batch.input_ids.shape[0]) // 2
    if pairs <= 0 or pairs >= n:
        return [batch]
    grid = int(batch.input_ids.shape[1]) - 1
    device = batch.input_ids.device
    parts = []
    for s in range(0, n, pairs):
        e = min(n, s + pairs)
        idx = torch.cat([torch.arange(s, e), torch.arange(n + s, n + e)]).to(device)
        new_row = torch.full((2 * n,), -1, dtype=torch.long, device=device)
        new_row[idx] = torch.arange(len(idx), device=device)
        row_of = batch.answer_positions // grid
        keep = new_row[row_of] >= 0
        at = batch.answer_positions[keep]
        mask = batch.attention_mask
        parts.append(Batch(
            batch.input_ids[idx], None if mask is None else mask[idx], batch.labels[idx],
            tokens=0, answer_positions=new_row[row_of[keep]] * grid + at % grid,
            answer_targets=batch.answer_targets[keep], answer_tokens=int(at.numel()),
        ))  # fmt: skip
    return parts


def reference_logps(loop: Loop, batch: Batch) -> Any:
    """`sequence_logps` of the model with its adapter disabled, without gradients."""
    import torch

    with torch.no_grad(), loop.model.disable_adapter(), loop.autocast():
        return sequence_logps(loop.model, batch)


def pair_numbers(loop: Loop, batch: Batch, beta: float) -> tuple[Any, Any, Any]:
    """(losses, chosen rewards, rejected rewards) of `batch`'s pairs, each
    (pairs,): the reference first, once, without gradients."""
    import torch.nn.functional as F

    ref = reference_logps(loop, batch)
    with loop.autocast():
        pol = sequence_logps(loop.model, batch)
    n = int(pol.shape[0]) // 2
    chosen, rejected = beta * (pol[:n] - ref[:n]), beta * (pol[n:] - ref[n:])
    return -F.logsigmoid(chosen - rejected), chosen, rejected


@dataclasses.dataclass
class Dpo:
    """DPO as the loop's objective (lorafleet_trainer.loop.Objective)."""

    beta: float = 0.1
    #: The padding token of the held-out batches.
    pad_id: int = 0
    #: The last evaluation's numbers (`evaluate`); empty before one.
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    #: The last step's sums over its pairs (tensors, read after the step).
    _sums: list[Any] = dataclasses.field(default_factory=list)

    def accumulate(self, loop: Loop, micro: list[Batch]) -> Any:
        """Forward and backward over one step's micro-batches; the step's
        loss (the mean over its pairs) as a tensor."""
        total, sums = None, None
        pairs = sum(int(b.input_ids.shape[0]) // 2 for b in micro)
        for b in micro:
            rows = pass_rows(loop.micro_tokens, int(b.input_ids.shape[1]), len(b.input_ids))
            # A pass of `rows` rows holds rows // 2 pairs (at least one).
            for part in pair_parts(b, max(1, rows // 2) if rows else 0):
                losses, chosen, rejected = pair_numbers(loop, part, self.beta)
                loss = losses.sum() / pairs
                if loop.scaler is not None:
                    loop.scaler.scale(loss).backward()
                else:
                    loss.backward()
                found = _sums(losses.detach(), chosen.detach(), rejected.detach())
                sums = found if sums is None else [a + b for a, b in zip(sums, found, strict=True)]
                total = loss.detach() if total is None else total + loss.detach()
        if total is None or sums is None:
            raise TrainingFailureError("a step with no micro-batch: the data plan is empty")
        self._sums = [*sums[1:], pairs]
        return total

    def step_metrics(self) -> dict[str, float]:
        """The last step's mean rewards, margin and accuracy over its pairs."""
        if not self._sums:
            return {}
        chosen, rejected, right, n = self._sums
        return _means(float(chosen), float(rejected), float(right), n)

    def evaluate(
        self, loop: Loop, tokens: Tokens, held: Sequence[int], p: Params
    ) -> dict[str, float]:
        """The held-out pairs' mean loss, rewards, margin and accuracy (dropout off)."""
        import torch

        # Sorted by length: a sum per pair does not depend on the order, and
        # like lengths together spare the padding.
        kept = sorted((n, i) for i, n in zip(held, tokens.lengths(held), strict=True) if n)
        order = [i for _, i in kept]
        sums = torch.zeros(4, dtype=torch.float64, device=loop.device)
        loop.model.eval()
        with torch.no_grad():
            for s in range(0, len(order), p.batch_size):
                batch = to_batch(tokens.get(order[s : s + p.batch_size]), self.pad_id, loop.device)
                sums += torch.stack(_sums(*pair_numbers(loop, batch, self.beta))).double()
        loop.model.train()
        loss, chosen, rejected, right = (float(x) for x in sums.tolist())
        n = max(len(kept), 1)
        found = _means(chosen, rejected, right, n)
        self.last_eval = {"eval_loss": loss / n, **{f"eval_{k}": v for k, v in found.items()}}
        return self.last_eval


def _sums(losses: Any, chosen: Any, rejected: Any) -> list[Any]:
    return [losses.sum(), chosen.sum(), rejected.sum(), (chosen > rejected).float().sum()]


def _means(chosen: float, rejected: float, right: float, n: int) -> dict[str, float]:
    return {
        "rewards_chosen": chosen / n,
        "rewards_rejected": rejected / n,
        "margin": (chosen - rejected) / n,
        "accuracy": right / n,
    }
