"""KVShare-style recompute that continues into decoding, for the fidelity study (``eval/fidelity.py``,
method ``kvshare``).

The prompt is prefilled as the store's default does (its selection at the budget, ``keep_cache``);
then, once the first answer token is known, that token's attention over the cached slots (summed
over layers, heads) picks the ``budget`` share of the document tokens it reads most, and those are
recomputed in the prompt's context (each attends to every slot at or before it in prompt order,
written over its stale state), as KVShare refreshes the most-attended stale tokens during decode.
The first token's row is then run again, so the second answer token and every later one read the
refreshed states. The first answer token itself is the prefill's: a refresh during decoding cannot
change it. TTFT is the prefill's (the refresh is decode time).
"""

from __future__ import annotations

import torch

from promptcache.engine.prefill.recompute import question_attention, recompute_request


def slot_map(layout) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """The cached slots of a prompt assembled in a private buffer (cached spans at slots 0.. in
    prompt order, new tokens after them): (prompt index of each slot, its token id, its position,
    the slots of document spans, the prompt index of each new token in buffer order)."""
    req = recompute_request(layout, 0, 0.0, "tail", False)
    docs, slot = [], 0
    for s in layout.spans:
        if s.kind == "cached":
            if s.name.startswith("doc:"):
                docs += range(slot, slot + len(s))
            slot += len(s)
    return list(req.slot_order), list(req.slot_ids), list(req.slot_pos), docs, list(req.new_order)


def refresh(pc, res, token: int, share: float) -> torch.Tensor:
    """Run the first answer ``token`` on ``res``'s kept cache, recompute the ``share`` of the
    document slots it attends to most in the prompt's context, and run ``token`` again over the
    refreshed states: its logits [V] (the second answer token's)."""
    cache, layout, pos = res.cache, res.layout, res.next_position
    order, ids, positions, docs, new_order = slot_map(layout)
    n_cached, prompt_len = len(order), len(layout.token_ids)
    tok = torch.tensor([[token]])
    at = cache.length  # the first answer token's slot
    per_layer = question_attention(pc.adapter, lambda: pc.adapter.forward(tok, torch.tensor([[pos]]), cache), n_cached)
    k = round(share * len(docs))
    if per_layer is None or k == 0:
        raise ValueError("kvshare needs the model's attention probabilities (eager attention) and a budget > 0")
    scores = per_layer.sum(0)
    chosen = sorted(sorted(docs, key=lambda s: -float(scores[s]))[:k], key=lambda s: order[s])
    # every slot's prompt index: cached slots, the new tokens in order, then the answer token
    kv_order = torch.tensor(order + new_order + [prompt_len])
    q = torch.tensor([order[s] for s in chosen])
    mask = (kv_order[None, :] <= q[:, None])[None, None]  # [1, 1, k, kv_len]: prompt order, causal
    pc.adapter.forward(torch.tensor([[ids[s] for s in chosen]]), torch.tensor([[positions[s] for s in chosen]]), cache,
                       write_slots=torch.tensor(chosen), attention_mask=mask)
    cache.set_length(at)  # the answer token again, over the refreshed states
    return pc.adapter.forward(tok, torch.tensor([[pos]]), cache)[0]


def greedy_with_refresh(pc, res, share: float, max_new: int, stop) -> list[int]:
    """Greedy answer ids on ``res``'s kept cache (the prompt's states as its prefill left them):
    the first from the prefill's logits, then one ``refresh`` of ``share`` of the document tokens,
    then one token a forward until ``stop(ids)`` or ``max_new`` tokens."""
    gen, pos = [int(res.logits.argmax())], res.next_position
    with torch.inference_mode():
        nxt = refresh(pc, res, gen[0], share)
        while not (len(gen) >= max_new or stop(gen)):
            gen.append(int(nxt.argmax()))
            pos += 1
            nxt = pc.adapter.forward(torch.tensor([[gen[-1]]]), torch.tensor([[pos]]), res.cache)[0]
    return gen


__all__ = ["greedy_with_refresh", "refresh", "slot_map"]
