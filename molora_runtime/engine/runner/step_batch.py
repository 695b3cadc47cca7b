"""The one object a step's metadata travels in: the host-side description of its flat token batch
(decodes first, then verifications of drafts, then prefill chunks), built by the scheduler, read
by the model runner and the output processor."""

from __future__ import annotations

from molora_runtime.engine.sequence import Sequence


class StepBatch:
    """Which tokens of which sequences one forward computes, where their K/V go, which rows
    produce logits. Built by the scheduler, read by the model runner and output processor."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.token_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[tuple[int, int]] = []  # (block, offset) each token's K/V is written to
        self.segments: list[tuple[Sequence, int, int]] = []  # (seq, start index in batch, n)
        self.decode_tables: list[list[int]] = []
        self.prefills: list[tuple[int, int, int, list[int]]] = []  # (start, n, pos, table)
        self.logits_index: list[int] = []
        self.logits_seqs: list[Sequence] = []
        self.prompt_logits_index: list[int] = []  # prompt_logprobs: batch index of position p
        self.prompt_logits_owner: list[tuple[Sequence, int]] = []  # (seq, p)
        self.verify: list[tuple[Sequence, int, int]] = []  # (seq, start, n): last token + draft
        self.verify_index: list[int] = []  # every verified row, after the sampled rows
        self.num_decode = 0  # decode rows (a verification counts one per token)

    @property
    def decode_only(self) -> bool:
        """No prefill chunk: every row a decode, so a captured graph can run the batch."""
        return not self.prefills

    @property
    def logit_rows(self) -> list[int]:
        """The batch rows the forward keeps logits for: sampled rows, then every verified draft
        row, then the prompt positions asking for logprobs (`StepResult` splits them so)."""
        return self.logits_index + self.verify_index + self.prompt_logits_index

    def computed(self) -> list[tuple[Sequence, int]]:
        """(seq, tokens) this forward put in the cache, for every sequence but a verified one
        (a verification commits only what it accepts)."""
        verified = {id(seq) for seq, _, _ in self.verify}
        return [(seq, n) for seq, _, n in self.segments if id(seq) not in verified]

    def halves(self) -> list[StepBatch]:
        """The batch's sequences in two sub-batches (decodes first in each), rebuilt from the
        sequences' unchanged state: nothing advances until the output processor runs."""
        segs = self.segments
        mid = len(segs) // 2
        makes_logits = {id(s) for s in self.logits_seqs}
        parts = []
        for group in (segs[:mid], segs[mid:]):
            part = StepBatch(self.block_size)
            for seq, _, n in group:
                part.add(seq, seq.num_computed, n, produces_logits=id(seq) in makes_logits)
            parts.append(part)
        return parts

    def add(self, seq: Sequence, pos: int, n: int, produces_logits: bool) -> None:
        """`n` tokens of `seq` from position `pos`: a prefill chunk, a decode, or (a decode with
        a draft) the last token and its draft, each token a decode row whose logits are kept."""
        start = len(self.token_ids)
        bs, table = self.block_size, seq.block_table
        verifying = bool(seq.draft) and not seq.in_prefill
        if verifying:  # each row a decode of its own: the same attention as plain decoding
            assert not self.prefills, "decodes come first"
            assert n == 1 + len(seq.draft), "a verification covers the whole draft"
            self.token_ids.append(seq.token_at(pos))
            self.token_ids.extend(seq.draft)
            for p in range(pos, pos + n):
                self.positions.append(p)
                self.slots.append((table[p // bs], p % bs))
                self.decode_tables.append(table)
            self.num_decode += n
            self.segments.append((seq, start, n))
            self.verify.append((seq, start, n))
            self.verify_index.extend(range(start, start + n))
            return
        if n == 1:  # a decode: no ranges to build
            self.token_ids.append(seq.token_at(pos))
            self.positions.append(pos)
            self.slots.append((table[pos // bs], pos % bs))
        else:
            self.token_ids.extend(seq.tokens(pos, pos + n))
            self.positions.extend(range(pos, pos + n))
            self.slots.extend((table[p // bs], p % bs) for p in range(pos, pos + n))
        self.segments.append((seq, start, n))
        if seq.in_prefill:
            self.prefills.append((start, n, pos, table))
            if seq.wants_prompt_logprobs:
                last = len(seq.prompt_ids) - 1  # its logits sample the first output token
                for i in range(n):
                    if pos + i < last:
                        self.prompt_logits_index.append(start + i)
                        self.prompt_logits_owner.append((seq, pos + i))
        else:
            assert not self.prefills, "decodes come first"
            self.decode_tables.append(table)
            self.num_decode += 1
        if produces_logits:
            self.logits_index.append(start + n - 1)
            self.logits_seqs.append(seq)
