from array import array
from collections import deque

import xxhash

from nanovllm.engine.sequence import Sequence

# Partial hits in pages of at least this many tokens (in smaller ones the tokens a partial hit would save cost
# less than the step it may wait for its source), of at least an eighth of a page.
PARTIAL_HIT_MIN_PAGE = 64
MAX_PROBED = 16         # cached blocks compared with a prompt for a partial hit, the oldest first


def _shared_length(cached: list[int], tokens: list[int], known: int) -> int:
    """How many leading tokens of `tokens` `cached` holds too, given the first `known` are equal: slices
    compared in C, halving the range (a prompt may share all of a page but its last token)."""
    low, high = known, len(tokens)
    if cached[:high] == tokens:
        return high
    while high - low > 1:                       # cached[:low] == tokens[:low], cached[:high] != tokens[:high]
        middle = (low + high) // 2
        if cached[low:middle] == tokens[low:middle]:
            low = middle
        else:
            high = middle
    return low


class Block:
    """A page of the KV cache: block_size token slots, shared by ref_count sequences."""

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []
        self.probe: tuple | None = None     # its key in BlockManager.probes, while it is hashed
        self.step = -1                      # the scheduling step that hashed it
        self.next_token = -1                # the token after it, once known (BlockManager.reads_next_token)

    def update(self, hash: int, token_ids: list[int], next_token: int = -1) -> None:
        self.hash = hash
        self.token_ids = token_ids
        self.next_token = next_token

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []
        self.next_token = -1


class BlockManager:
    """Paged KV memory with a prefix cache.

    A full, computed block is keyed by a hash chained over every block before it, so equal hashes mean
    equal prefixes; a hit is still checked against the block's tokens. Freed blocks keep their hash
    and content until they are handed out again, so a later request (or a preempted one) can revive them.

    A prompt that goes on sharing tokens with a cached block past its last full hit (a system prompt that
    does not end on a page boundary, the same document with other questions) gets a partial hit: a fresh
    block, a copy of the cached one made before its step (`partial_hit`), and only the tokens after the
    shared ones to compute. Blocks are found for it by `probes`: the prefix hash before them and their first
    `min_partial` tokens, the least a partial hit is worth a block copy for.

    `reads_next_token`: a drafter's K/V at a position also depend on the token after it (an EAGLE-3 head:
    engine/eagle3_proposer.py), so a block's K/V at its last position depend on a token its hash does not
    cover. A block then records that token (`next_token`) and is a full hit only where it matches; else
    it is a partial hit of all but its last token (that position is computed again, into a copy), and a
    partial hit stops a token earlier wherever the cached block's next token differs. Completions split
    off a prompt each get a copy of the block holding its last token, full or not, to write their own.

    A drafter may also leave a position of a sequence unwritten for a while (a draft model's last draft when
    all were accepted: engine/draft_model.py): `hold_back` keeps the block holding it, and those after it,
    out of the cache until `drafter_wrote_from` says the drafter has computed it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 reads_next_token: bool = False):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.reads_next_token = reads_next_token
        self.held_back: dict[int, int] = {}         # seq_id -> a position its drafter's K/V lack
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # reads_next_token: (hash, the token after the block) -> block id, beside the newest block of a hash
        self.followed_to_block_id: dict[tuple[int, int], int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.min_partial = max(block_size // 8, 1) if block_size >= max(PARTIAL_HIT_MIN_PAGE, 2) else 0
        self.probes: dict[tuple, list[int]] = {}    # (prefix hash, first min_partial tokens) -> block ids
        self.step = 0                               # scheduling steps begun (start_step)
        self._version = 0                           # blocks registered or forgotten (_lookup's answer is kept until)
        self._last_lookup: tuple[tuple, tuple] = ((), ([], None))

    @staticmethod
    def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(array("q", token_ids).tobytes())
        return h.intdigest()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def start_step(self) -> None:
        """A scheduling step begins: what it hashes is written by its own step (see partial_hit)."""
        self.step += 1

    def _caches_for(self, seq: Sequence) -> bool:
        """A sequence that wants its prompt's log-probs hits nothing: they come from logits of every
        prompt position."""
        return self.enable_prefix_caching and seq.prompt_logprobs is None

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding seq's leading full blocks. The block with the last token is never a hit:
        its logits must be computed, and a shared block must not be written."""
        return self._lookup(seq)[0]

    def partial_hit(self, seq: Sequence) -> tuple[int, int, bool] | None:
        """The cached block sharing the most tokens (at least min_partial) with seq's first block past its
        full hits, if any: (its id, the tokens shared, whether the step being scheduled writes it). Shared
        tokens stop before seq's last token, whose logits are needed. A block an earlier step wrote wins over
        one this step writes, which cannot be copied before the step: for that one alone the scheduler lets
        seq wait a step (the prompts after a prefix's first share it with each other too, and would
        otherwise start one at a time)."""
        return None if seq.block_table else self._lookup(seq)[1]

    def _lookup(self, seq: Sequence) -> tuple[list[int], tuple[int, int, bool] | None]:
        """seq's full hits and partial hit in the prefix cache. An admission asks up to four times (the
        scheduler's partial-hit check, can_allocate, allocate's partial hit and its hits): the answer is kept
        while no block is registered or forgotten and no step begins."""
        if not self._caches_for(seq):
            return [], None
        key = (seq.seq_id, seq.num_tokens, self._version, self.step)
        if self._last_lookup[0] != key:
            hits, h, partial = [], -1, None
            for i in range((seq.num_tokens - 1) // self.block_size):
                token_ids = seq.block(i)
                h = self.compute_hash(token_ids, h)
                block_id = self.hash_to_block_id.get(h, -1)
                if self.reads_next_token:
                    following = seq[(i + 1) * self.block_size]
                    block_id = self.followed_to_block_id.get((h, following), block_id)
                if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                    break
                block = self.blocks[block_id]
                if self.reads_next_token and block.next_token != following:
                    # its last position read another token (or one not known yet): all but that position
                    partial = (block_id, self.block_size - 1, block.step == self.step)
                    break
                hits.append(block_id)
            if partial is None:
                partial = self._partial_after(seq, hits)
            self._last_lookup = (key, (hits, partial))
        return self._last_lookup[1]

    def _partial_after(self, seq: Sequence, hits: list[int]) -> tuple[int, int, bool] | None:
        """partial_hit, given seq's full hits."""
        first = len(hits) * self.block_size
        room = min(seq.num_tokens - 1 - first, self.block_size - 1)     # a whole block's match is a full hit
        if not self.min_partial or room < self.min_partial:
            return None
        tokens = seq[first:first + room]
        prefix_hash = self.blocks[hits[-1]].hash if hits else -1
        best, best_key = None, None
        for block_id in self.probes.get((prefix_hash, *tokens[:self.min_partial]), ())[:MAX_PROBED]:
            block = self.blocks[block_id]
            shared = _shared_length(block.token_ids, tokens, self.min_partial)
            written_now = block.step == self.step
            if best_key is None or (not written_now, shared) > best_key:
                best, best_key = (block_id, shared, written_now), (not written_now, shared)
        if best is not None and self.reads_next_token:
            block_id, shared, written_now = best
            if self.blocks[block_id].token_ids[shared] != seq[first + shared]:
                shared -= 1             # the cached position shared - 1 read a token seq does not have
            best = (block_id, shared, written_now) if shared >= max(self.min_partial, 1) else None
        return best

    def _forget(self, block: Block) -> None:
        """The block's content is about to change, or was never written: no hit may find it."""
        if block.hash != -1:
            self._version += 1
            if self.hash_to_block_id.get(block.hash) == block.block_id:
                del self.hash_to_block_id[block.hash]
            if self.followed_to_block_id.get((block.hash, block.next_token)) == block.block_id:
                del self.followed_to_block_id[(block.hash, block.next_token)]
        if block.probe is not None:
            self.probes[block.probe].remove(block.block_id)
            if not self.probes[block.probe]:
                del self.probes[block.probe]
            block.probe = None

    def _allocate_block(self, block_id: int) -> Block:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        self._forget(block)                         # its old content is about to be overwritten
        block.reset()
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return block

    def _revive_or_share(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block_id in self.used_block_ids:
            block.ref_count += 1
        else:                                        # a freed block that still holds this prefix
            assert block.ref_count == 0
            block.ref_count = 1
            self.free_block_ids.remove(block_id)
            self.used_block_ids.add(block_id)

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        """Whether allocate(seq) finds the free blocks it needs and leaves `reserve` of them free."""
        if seq.block_table:     # holding its prompt's full blocks (share_prompt): only the rest are new
            return seq.num_blocks - len(seq.block_table) + reserve <= len(self.free_block_ids)
        hits = self._cached_prefix(seq)
        num_shared = sum(1 for block_id in hits if block_id in self.used_block_ids)
        return seq.num_blocks - num_shared + reserve <= len(self.free_block_ids)

    def allocate(self, seq: Sequence) -> tuple[int, int] | None:
        """Give seq blocks for all its tokens, reusing cached prefix blocks (num_cached_tokens counts them).
        A completion that already holds its prompt's leading blocks (share_prompt) gets fresh ones for
        the rest: the block with the prompt's last token is never a hit anyway. Returns the block copy a
        partial hit needs before seq's step, (cached block, seq's block), if any, where an earlier step
        wrote the cached block (else its shared tokens are computed again); whatever this step writes
        comes after the copy, even into the cached block itself, handed out again."""
        assert not seq.num_pending_tokens
        partial = None
        if not seq.block_table:
            partial = self.partial_hit(seq)
            if partial is not None and partial[2]:
                partial = None
            hits = self._cached_prefix(seq)
            for block_id in hits:
                self._revive_or_share(block_id)
                seq.block_table.append(block_id)
            seq.num_cached_tokens = len(hits) * self.block_size
        for _ in range(len(seq.block_table), seq.num_blocks):
            seq.block_table.append(self._allocate_block(self.free_block_ids[0]).block_id)
        if partial is None:
            return None
        seq.num_cached_tokens += partial[1]
        return partial[0], seq.block_table[seq.num_cached_tokens // self.block_size]

    def forget_unwritten(self, seq: Sequence) -> None:
        """seq's scheduled step will never run (it was aborted): its blocks registered for that step
        hold nothing, so they must not be hit."""
        for block_id in seq.block_table[seq.num_cached_tokens // self.block_size:]:
            block = self.blocks[block_id]
            self._forget(block)
            block.update(-1, [])

    def _release(self, block_id: int) -> None:
        """One reference to the block fewer; the last one frees it (its hash stays: a later hit revives it)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.used_block_ids.remove(block_id)
            self.free_block_ids.append(block_id)

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()
        self.held_back.pop(seq.seq_id, None)        # recomputed, if ever, drafter's K/V too

    def hold_back(self, seq: Sequence, position: int) -> None:
        """seq's drafter has not written its K/V at `position`: no block from the one holding it is published."""
        self.held_back[seq.seq_id] = position

    def unwritten_position(self, seq: Sequence) -> int | None:
        """The position held back for seq's drafter (hold_back), if any."""
        return self.held_back.get(seq.seq_id)

    def drafter_wrote_from(self, seq: Sequence, position: int) -> None:
        """seq's drafter computed its K/V from `position` on: a position held back there or after is written."""
        if self.held_back.get(seq.seq_id, -1) >= position:
            del self.held_back[seq.seq_id]

    def can_append(self, seq: Sequence) -> bool:
        """Whether seq's last token (computed next decode step) has a slot, or a free block can give one."""
        return len(seq.block_table) >= seq.num_blocks or len(self.free_block_ids) >= 1

    def may_append(self, seq: Sequence) -> None:
        if len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._allocate_block(self.free_block_ids[0]).block_id)

    def reserve_lookahead(self, seq: Sequence, num_slots: int) -> int:
        """Slots for up to num_slots tokens past seq's last one (speculative decoding's drafts, computed in
        the same step), from free blocks as far as they go; returns how many it has. Their KV is written
        but never hashed: hash_blocks goes by num_cached_tokens, which counts only accepted tokens."""
        have = len(seq.block_table) * self.block_size - seq.num_tokens
        wanted = -(-(num_slots - have) // self.block_size)
        for _ in range(min(max(wanted, 0), len(self.free_block_ids))):
            seq.block_table.append(self._allocate_block(self.free_block_ids[0]).block_id)
        return min(num_slots, len(seq.block_table) * self.block_size - seq.num_tokens)

    def release_lookahead(self, seq: Sequence) -> None:
        """Free the blocks past seq's tokens that reserve_lookahead gave it (they hold rejected drafts'
        KV only, and were never hashed)."""
        while len(seq.block_table) > seq.num_blocks:
            block_id = seq.block_table.pop()
            assert self.blocks[block_id].ref_count == 1 and self.blocks[block_id].hash == -1
            self._release(block_id)

    def can_fork(self, seq: Sequence, num_children: int) -> bool:
        """Whether num_children completions split off seq can each get a copy of its partial last block."""
        return self.num_forkable(seq, num_children) == num_children

    def num_forkable(self, seq: Sequence, wanted: int) -> int:
        """How many of `wanted` completions can be split off seq now: each needs a free block for its
        copy of a partial last block; over whole blocks they need none (unless reads_next_token)."""
        if seq.num_tokens % self.block_size == 0 and not self.reads_next_token:
            return wanted
        return min(wanted, len(self.free_block_ids))

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """child shares parent's blocks (one more reference each), but a partial last block, which both
        will write, becomes a fresh block; returns (parent's block, child's block) to copy, if any. With
        reads_next_token the last block is copied even when full: its last position reads the child's
        own first token."""
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1
        if parent.num_tokens % self.block_size == 0 and not self.reads_next_token:
            return None
        last = child.block_table[-1]
        self.blocks[last].ref_count -= 1
        child.block_table[-1] = self._allocate_block(self.free_block_ids[0]).block_id
        return last, child.block_table[-1]

    def share_prompt(self, source: Sequence, seq: Sequence) -> tuple[int, int] | None:
        """seq, a completion of source's request that cannot start yet, takes a reference to each of
        source's blocks that holds prompt tokens only and not the prompt's last token: they stay alive
        for it (prefix cache or not), and when it starts it computes just the rest of the prompt, whose
        last token gives its first token's logits. A prompt that ends on a block boundary would leave a
        whole block to recompute: seq gets its own copy of that block instead (returned as (source's
        block, seq's block), to copy once this step has written it, as fork does), if a block is free,
        and then recomputes only the prompt's last token, into its copy."""
        assert not seq.block_table and len(source.block_table) * self.block_size >= source.num_prompt_tokens
        num_prompt_tokens = source.num_prompt_tokens
        num_shared = (num_prompt_tokens - 1) // self.block_size
        seq.block_table = source.block_table[:num_shared]
        for block_id in seq.block_table:
            self.blocks[block_id].ref_count += 1
        seq.num_cached_tokens = num_shared * self.block_size
        if num_prompt_tokens % self.block_size or not self.free_block_ids:
            return None
        last = source.block_table[num_shared]
        seq.block_table.append(self._allocate_block(self.free_block_ids[0]).block_id)
        seq.num_cached_tokens = num_prompt_tokens - 1
        return last, seq.block_table[-1]

    def hash_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Register seq's full blocks whose KV is computed, or will be by a step already scheduled
        (`num_computed`: tokens computed once it runs), and whose tokens are known, so later requests can
        hit them. A reader in the same step is safe: each layer stores the step's K/V before its
        attention reads; a reader in a later step queues behind it on the device."""
        if not self.enable_prefix_caching:
            return
        if num_computed is None:
            num_computed = seq.num_cached_tokens
        num_known = seq.num_tokens - seq.num_pending_tokens
        end = min(num_computed, num_known, self.held_back.get(seq.seq_id, num_known)) // self.block_size
        start = end
        while start > 0 and self.blocks[seq.block_table[start - 1]].hash == -1:
            start -= 1
        if self.reads_next_token and 0 < start and start * self.block_size < num_known:
            # registered before the token after it was known (a prompt's last token was sampled since)
            block = self.blocks[seq.block_table[start - 1]]
            if block.next_token == -1:
                block.next_token = seq[start * self.block_size]
                self.followed_to_block_id[(block.hash, block.next_token)] = block.block_id
                self._version += 1
        h = self.blocks[seq.block_table[start - 1]].hash if start > 0 else -1
        for i in range(start, end):
            token_ids = seq.block(i)
            prefix_hash, h = h, self.compute_hash(token_ids, h)
            block = self.blocks[seq.block_table[i]]
            following = (i + 1) * self.block_size
            block.update(h, token_ids, seq[following] if self.reads_next_token and following < num_known else -1)
            block.step = self.step
            duplicate = h in self.hash_to_block_id      # the same prefix in another block: a probe already
            self.hash_to_block_id[h] = block.block_id
            if block.next_token != -1:
                self.followed_to_block_id[(h, block.next_token)] = block.block_id
            self._version += 1
            if self.min_partial and not duplicate:
                block.probe = (prefix_hash, *token_ids[:self.min_partial])
                self.probes.setdefault(block.probe, []).append(block.block_id)
