"""A small GPT for character-level language modelling (nanoGPT's layout, SDPA attention)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rayacc.models.init import init_parameters


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each position's place in its example (packed rows: `documents` [B, T] numbers the
    examples of a row in order): 0 where an example starts."""
    t = documents.shape[1]
    index = torch.arange(t, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] True where a position may attend: earlier or itself, in its own example."""
    t = documents.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()
    return (causal & (documents[:, :, None] == documents[:, None, :])).unsqueeze(1)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.head_size = n_embd // n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x, mask: torch.Tensor | None = None):
        b, t, _ = x.shape
        # the heads this rank holds: all of them, or its share under tensor parallelism
        qkv = self.qkv(x)
        q, k, v = qkv.split(qkv.shape[-1] // 3, dim=2)
        q, k, v = (z.view(b, t, -1, self.head_size).transpose(1, 2) for z in (q, k, v))
        # SDPA picks the flash / memory-efficient kernel when one applies (causal, no mask)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, -1))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x, mask: torch.Tensor | None = None):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float = 0.0,
        seed: int = 0,
    ):
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.n_layer = n_layer
        init_parameters(self, seed)

    def initial_value(self, name: str, shape: torch.Size, generator: torch.Generator):
        """nanoGPT's initialisation, drawn per parameter (models/init.py): N(0, 0.02) for
        embeddings and linear weights, scaled by 1/sqrt(2 · layers) for the projections into the
        residual stream; zero biases; unit LayerNorm gains."""
        owner, _, leaf = name.rpartition(".")
        if isinstance(self.get_submodule(owner), nn.LayerNorm) and leaf == "weight":
            return torch.ones(shape)
        if leaf == "bias":
            return torch.zeros(shape)
        std = 0.02
        if name.endswith(("proj.weight", "mlp.2.weight")):
            std /= math.sqrt(2 * self.n_layer)
        return torch.empty(shape).normal_(0.0, std, generator=generator)

    def fsdp_blocks(self) -> list[nn.Module]:
        """The transformer blocks this model holds (a pipeline stage: its share)."""
        blocks = self.blocks
        return list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)

    def pipeline_units(self) -> list[int]:
        """The parameters of each unit a pipeline splits between its stages, in order: the
        embeddings, each block, the final norm with the head (tied: counted with both)."""
        count = lambda *ms: sum(p.numel() for m in ms for p in m.parameters())  # noqa: E731
        return [count(self.tok, self.pos), *map(count, self.blocks), count(self.ln_f, self.head)]

    def pipeline_tied(self) -> dict[str, str]:
        """A parameter of a later stage → the one it shares its value with on the first."""
        return {"head.weight": "tok.weight"}

    def keep_pipeline_units(self, units: range) -> GPT:
        """This model cut down, in place, to `units` (`pipeline_units`' indices): the blocks
        keep their names (a stage's state is the whole model's under the same keys); a stage
        without the embeddings takes hidden states, one without the head gives them. The
        head's weight, tied to the embedding, becomes a parameter of its own on a last stage
        that lacks the embedding (the pipeline sums the two copies' gradients)."""
        last = self.n_layer + 1
        if 0 not in units:
            if last in units and self.tok is not None:
                # its own copy, frozen where the embedding is (a LoRA base)
                weight = self.head.weight
                self.head.weight = nn.Parameter(weight.detach().clone(), weight.requires_grad)
            self.tok = self.pos = self.drop = None
        if last not in units:
            self.ln_f = self.head = None
        blocks = self.blocks
        held = dict(blocks.items()) if isinstance(blocks, nn.ModuleDict) else {
            str(i): b for i, b in enumerate(blocks)}  # fmt: skip
        self.blocks = nn.ModuleDict({str(i - 1): held[str(i - 1)] for i in units if 0 < i < last})
        return self

    def tp_plan(self) -> dict:
        """Megatron's split of each block over a tensor-parallel group: q, k, v and the MLP's
        first layer by output columns (each rank its heads), the projections back by input
        rows (one all-reduce each); embeddings, norms and the tied head stay whole."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from rayacc.engine.parallel.tensor import FusedColwise

        return {
            "blocks.*.attn.qkv": FusedColwise(3),
            "blocks.*.attn.proj": RowwiseParallel(),
            "blocks.*.mlp.0": ColwiseParallel(),
            "blocks.*.mlp.2": RowwiseParallel(),
        }

    def flops_per_item(self, item_shape=None) -> float:
        """Training FLOPs per target token (forward + backward), as nanoGPT and the bare
        anchor count them: 6 × parameters + 12 × layers × heads × head size × sequence."""
        n = sum(p.numel() for p in self.parameters())
        seq = item_shape[-1] if item_shape else self.block_size
        # a pipeline stage: its own parameters and blocks
        blocks = self.fsdp_blocks()
        width = blocks[0].attn.qkv.in_features if blocks else 0
        return 6.0 * n + 12.0 * len(blocks) * width * seq

    def recompute_flops_per_item(self, item_shape=None) -> float:
        """FLOPs per target token that activation checkpointing adds: the forward of each
        recomputed block again in backward (2 × its parameters + 4 × heads × head size ×
        sequence), hardware FLOPs beyond the model's."""
        seq = item_shape[-1] if item_shape else self.block_size
        return sum(
            2.0 * sum(p.numel() for p in block.parameters())
            + 4.0 * block.attn.qkv.in_features * seq
            for block in self.fsdp_blocks()
            if getattr(block, "recomputed", False)
        )

    def generate(
        self,
        idx: torch.Tensor,
        new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """`idx` (B, T) followed by `new_tokens` sampled ids (models/generate.py)."""
        from rayacc.models.generate import generate

        return generate(
            self, idx, new_tokens, temperature=temperature, top_k=top_k, generator=generator
        )

    def forward(
        self,
        idx: torch.Tensor,
        return_hidden: bool = False,
        head_loss: Callable[[torch.Tensor, nn.Linear], torch.Tensor] | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits; with `return_hidden` the final hidden states that `head` projects (a chunked
        loss applies the head itself, never holding all the logits); with `head_loss`, its
        value on (hidden states, head), computed inside this forward — where a sharded
        model's parameters are whole. `documents` (packed rows: each position's example):
        each example attends to itself only and its positions start at 0, as on a row of
        its own."""
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens exceeds model.block_size={self.block_size}")
        mask = None
        if documents is None:
            pos = torch.arange(t, device=idx.device)
        else:
            pos, mask = document_positions(documents), document_mask(documents)
        # a pipeline stage without the embeddings takes the hidden states of the one before
        x = idx if self.tok is None else self.drop(self.tok(idx) + self.pos(pos))
        for block in self.fsdp_blocks():
            x = block(x, mask)
        if self.head is None:  # a pipeline stage before the last: its hidden states go on
            return x
        hidden = self.ln_f(x)
        if head_loss is not None:
            return head_loss(hidden, self.head)
        return hidden if return_hidden else self.head(hidden)
