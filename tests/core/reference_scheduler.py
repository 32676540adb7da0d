"""The scheduler as it was before the vectorised fast path: one Python loop over every request.

Kept as the slow, obviously-correct reference that `test_fast_path_matches_reference` runs
side by side with the real `Scheduler`: the same workload must give byte-identical step
messages and the same tokens. Only the block pool and the wire structs are shared with the
package (the pool's LRU and reference counts are not what the fast path changes).
"""

from __future__ import annotations

from collections import deque

from tokenmill.core.block_pool import BlockPool
from tokenmill.protocol import (BatchDiff, CachedRequestData, EngineCoreOutput, FinishReason, ModelRunnerOutput,
                                NewRequestData, SchedulerOutput, pack_ids, unpack_ids)
from tokenmill.sampling_params import SamplingParams


class RefRequest:
    def __init__(self, handle: int, prompt: list[int], params: SamplingParams, eos: tuple[int, ...],
                 max_model_len: int) -> None:
        self.handle, self.params = handle, params
        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.prompt_logprobs_from = 0  # prompt positions computed before a preemption
        self.num_cached_tokens = -1
        self.running = self.finished = False
        self.finish_reason: FinishReason | None = None
        self.stop_token_id: int | None = None
        self.block_hashes: list[int] = []
        self.stop_ids = frozenset(() if params.ignore_eos else eos) | frozenset(params.stop_token_ids or ())
        room = max_model_len - len(prompt)
        self.max_output_tokens = room if params.max_tokens is None else min(params.max_tokens, room)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_output(self, token: int) -> bool:
        self.token_ids.append(token)
        n = len(self.token_ids) - self.num_prompt_tokens
        if token in self.stop_ids and n > self.params.min_tokens:
            self.finish_reason = FinishReason.STOP
            if self.params.stop_token_ids and token in self.params.stop_token_ids:
                self.stop_token_id = token
            return True
        if n >= self.max_output_tokens:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False


class RefKV:
    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bs, self.caching = block_size, caching
        self.pool = BlockPool(num_blocks, caching)
        self.blocks: dict[int, list[int]] = {}
        self.num_cached_blocks: dict[int, int] = {}
        self.queries = self.hits = 0

    def needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.bs)

    def find_cached_prefix(self, r: RefRequest) -> list[int]:
        if not self.caching:
            return []
        self._hashes(r)
        hits = []
        for h in r.block_hashes[:(r.num_tokens - 1) // self.bs]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, r: RefRequest, num_new: int, cached: list[int] | None = None) -> list[int] | None:
        held = self.blocks.get(r.handle, [])
        cached = cached or []
        num_computed = r.num_computed_tokens + len(cached) * self.bs
        need = self.needed(num_computed + num_new) - len(held) - len(cached)
        if need + sum(1 for b in cached if self.pool.ref_counts[b] == 0) > self.pool.num_free:
            return None
        self.pool.touch(cached)
        new = self.pool.allocate(max(need, 0))
        held = self.blocks.setdefault(r.handle, [])
        held.extend(cached)
        held.extend(new)
        self.num_cached_blocks[r.handle] = max(self.num_cached_blocks.get(r.handle, 0), len(cached))
        if self.caching:
            num_full = min(num_computed + num_new, r.num_tokens) // self.bs
            start = self.num_cached_blocks[r.handle]
            if num_full > start:
                self._hashes(r)
                for i in range(start, num_full):
                    self.pool.cache(held[i], r.block_hashes[i])
                self.num_cached_blocks[r.handle] = num_full
        return list(cached) + new

    def free(self, r: RefRequest) -> None:
        self.num_cached_blocks.pop(r.handle, None)
        self.pool.release(reversed(self.blocks.pop(r.handle, [])))

    def _hashes(self, r: RefRequest) -> None:
        while (len(r.block_hashes) + 1) * self.bs <= r.num_tokens:
            i = len(r.block_hashes)
            parent = r.block_hashes[-1] if r.block_hashes else None
            r.block_hashes.append(hash((parent, tuple(r.token_ids[i * self.bs:(i + 1) * self.bs]))))


class ReferenceScheduler:
    def __init__(self, max_num_seqs: int, budget: int, block_size: int, caching: bool, num_blocks: int) -> None:
        self.max_num_seqs, self.budget = max_num_seqs, budget
        self.kv = RefKV(num_blocks, block_size, caching)
        self.requests: dict[int, RefRequest] = {}
        self.waiting: deque[RefRequest] = deque()
        self.running: list[RefRequest] = []
        self.num_pending: dict[int, int] = {}
        self.known: set[int] = set()
        self.finished_to_send: list[int] = []
        self.step_id = 0
        self.num_preemptions = 0
        self.prev_handles: list[int] = []

    def add_request(self, r: RefRequest) -> None:
        self.requests[r.handle] = r
        self.waiting.append(r)

    def abort(self, handles: list[int]) -> None:
        for handle in handles:
            r = self.requests.get(handle)
            if r is None:
                continue
            (self.running if r.running else self.waiting).remove(r)
            r.finish_reason = FinishReason.ABORT
            self._finish(r)

    def schedule(self) -> SchedulerOutput | None:
        budget = self.budget
        scheduled: list[tuple[RefRequest, int]] = []
        new_blocks: dict[int, list[int]] = {}
        preempted: list[int] = []
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            pending = self.num_pending.get(r.handle, 0)
            done = r.num_tokens - r.num_prompt_tokens + pending >= r.max_output_tokens
            num_new = min(0 if done else r.num_tokens + pending - r.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            blocks = self.kv.allocate(r, num_new)
            while blocks is None:
                victim = self.running.pop()
                self.kv.free(victim)
                victim.prompt_logprobs_from = max(victim.prompt_logprobs_from,
                                                  min(victim.num_computed_tokens, victim.num_prompt_tokens))
                victim.running, victim.num_computed_tokens = False, 0
                self.known.discard(victim.handle)
                self.waiting.appendleft(victim)
                self.num_preemptions += 1
                preempted.append(victim.handle)
                if victim is r:
                    break
                blocks = self.kv.allocate(r, num_new)
            if blocks is None:
                break
            scheduled.append((r, num_new))
            if blocks:
                new_blocks[r.handle] = blocks
            budget -= num_new
            i += 1
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if self.num_pending.get(r.handle):
                break
            cached = [] if r.params.prompt_logprobs is not None else self.kv.find_cached_prefix(r)
            if r.num_cached_tokens < 0:
                r.num_cached_tokens = len(cached) * self.kv.bs
            num_hit = len(cached) * self.kv.bs
            num_new = min(r.num_tokens - num_hit, budget)
            if self.kv.allocate(r, num_new, cached) is None:
                break
            r.num_computed_tokens = num_hit
            self.waiting.popleft()
            self.kv.queries += r.num_tokens
            self.kv.hits += num_hit
            r.running = True
            self.running.append(r)
            scheduled.append((r, num_new))
            budget -= num_new
        if not scheduled and not preempted and not self.finished_to_send:
            return None
        new_requests, grown = [], []
        for r, num_new in scheduled:
            if r.handle not in self.known:
                self.known.add(r.handle)
                new_requests.append(NewRequestData(
                    r.handle, pack_ids(r.token_ids), r.num_prompt_tokens, r.params,
                    pack_ids(self.kv.blocks[r.handle]), r.num_computed_tokens,
                    prompt_logprobs_from=r.prompt_logprobs_from))
            elif r.handle in new_blocks:
                grown.append((r.handle, new_blocks[r.handle]))
            r.num_computed_tokens += num_new
            pending = self.num_pending.get(r.handle, 0)
            if r.num_computed_tokens == r.num_tokens + pending:
                self.num_pending[r.handle] = pending + 1
        self.step_id += 1
        so = SchedulerOutput(step_id=self.step_id, new_requests=new_requests,
                             cached_requests=CachedRequestData.pack([h for h, _ in grown], [len(b) for _, b in grown],
                                                                    [x for _, b in grown for x in b]),
                             finished_handles=self.finished_to_send, preempted_handles=preempted)
        self._encode_batch(so, {r.handle: n for r, n in scheduled})
        self.finished_to_send = []
        return so

    def _encode_batch(self, so: SchedulerOutput, scheduled: dict[int, int]) -> None:
        prev = self.prev_handles
        removed = [i for i, h in enumerate(prev) if h not in scheduled]
        kept = [h for h in prev if h in scheduled]
        added = [h for h in scheduled if h not in set(kept)]
        handles = kept + added
        counts = [scheduled[h] for h in handles]
        odd = [i for i, n in enumerate(counts) if n != 1]
        diff = BatchDiff(count_rows=pack_ids(odd), count_values=pack_ids([counts[i] for i in odd]))
        if len(removed) + len(added) <= len(handles):
            diff.removed_rows, diff.added = pack_ids(removed), pack_ids(added)
        else:
            diff.full = pack_ids(handles)
        so.batch = None if diff == BatchDiff() else diff
        self.prev_handles = so.ref_handles = handles

    def update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        counts = [1] * len(so.ref_handles)
        for row, n in zip(unpack_ids(out.count_rows), unpack_ids(out.count_values)):
            counts[row] = n
        tokens, pos, rows = unpack_ids(out.sampled), 0, []
        for n in counts:
            rows.append(tokens[pos:pos + n])
            pos += n
        outputs = []
        for row, (handle, sampled) in enumerate(zip(so.ref_handles, rows)):
            prompt_lp = out.prompt_logprobs[row] if out.prompt_logprobs else None
            if not sampled:
                if prompt_lp is not None and handle in self.requests:
                    outputs.append(EngineCoreOutput(handle, [], prompt_logprobs=prompt_lp))
                continue
            self.num_pending[handle] -= 1
            r = self.requests.get(handle)
            if r is None:
                continue
            new_tokens, finished = [], False
            for token in sampled:
                new_tokens.append(token)
                if r.append_output(token):
                    finished = True
                    break
            if finished:
                (self.running if r.running else self.waiting).remove(r)
                self._finish(r)
            outputs.append(EngineCoreOutput(
                handle, new_tokens, r.finish_reason, r.stop_token_id,
                out.logprobs[row] if out.logprobs else None, prompt_lp, max(r.num_cached_tokens, 0)))
        for handle in list(self.num_pending):
            if self.num_pending[handle] == 0 and handle not in self.requests:
                del self.num_pending[handle]
        return outputs

    def _finish(self, r: RefRequest) -> None:
        r.finished, r.running = True, False
        self.kv.free(r)
        del self.requests[r.handle]
        if r.handle in self.known:
            self.known.discard(r.handle)
            self.finished_to_send.append(r.handle)
        if not self.num_pending.get(r.handle):
            self.num_pending.pop(r.handle, None)
