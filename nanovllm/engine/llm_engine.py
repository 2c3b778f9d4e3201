import atexit
from functools import partial
from time import perf_counter

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import REASONING_MARKERS, Config
from nanovllm.distributed.workers import Workers, refuse_in_spawn_bootstrap
from nanovllm.engine.messages import CompletionUpdate
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.step_outputs import completion_updates, record_logprobs, record_prompt_logprobs
from nanovllm.engine.request_check import RequestLimits, checked_request
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.spec_decode import SpeculativeDecoding, count_accepted
from nanovllm.engine.structured_output import StructuredOutputs
from nanovllm.sampling_params import SamplingParams


class LLMEngine:
    """Tokenizes requests, runs the schedule -> model -> postprocess loop, and detokenizes results."""

    def __init__(self, model: str, **kwargs):
        refuse_in_spawn_bootstrap()     # a TP worker re-importing an unguarded script: say so, do not start
        Config.check_arguments(kwargs)
        self._exited = True
        self._cut_short = False     # a call to the ranks broke off midway: they may be out of step
        self._in_flight = None      # (sequences awaiting each row, SampledTokens) of the step launched last
        self._drained = False     # speculative decoding: the last step collected the one in flight, to speculate
        self._ended_seq_ids: list[int] = []     # told to the runner with the next step (frees sampling state)
        self.updates: list[CompletionUpdate] = []     # what the last step's collected tokens told each completion
        config = Config(model, **kwargs)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        if self.tokenizer.eos_token_id is not None:
            config.eos_token_ids = config.eos_token_ids | {self.tokenizer.eos_token_id}
        # ranks 1..N-1 start building beside rank 0, each its own ModelRunner
        self.workers = Workers(config.tensor_parallel_size, config.device, partial(ModelRunner, config))
        try:
            self.model_runner = ModelRunner(config, 0, self.workers.join_group())
            self.workers.open_channel()
        except BaseException as error:
            try:
                self.workers.explain(error)     # a worker died: say which, how, and what it printed
            finally:
                self.workers.stop(graceful=False)
            raise
        self.scheduler = Scheduler(config, self.model_runner.num_kvcache_blocks)
        self.spec_decode = SpeculativeDecoding(config, self.scheduler, partial(self._call, "propose_drafts")) \
            if config.speculative_config else None
        self.limits = RequestLimits(config.hf_config.vocab_size, config.max_model_len, config.kvcache_block_size,
                                    self.model_runner.num_kvcache_blocks, config.eos_token_ids)
        self.vocab_size = config.hf_config.vocab_size
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.vocab_size, config.eos_token_ids,
                                                    REASONING_MARKERS.get(config.reasoning_parser),
                                                    pin_memory=config.device == "cuda")
        if config.device == "cuda":     # a CPU engine (tests) saves the thread its time
            self.structured_outputs.prepare_in_background()
        self._exited = False
        atexit.register(self.exit)

    def exit(self) -> None:
        """Stop the workers and free the device memory; safe to call twice, and called at exit."""
        if self._exited:
            return
        self._exited = True
        atexit.unregister(self.exit)
        model_runner = self.model_runner
        del self.model_runner
        # ranks out of step, or one dead: the workers cannot be asked to leave, so they are killed
        self.workers.stop(model_runner.exit, graceful=not self._cut_short)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.exit()

    def _call(self, method_name: str, *args, rank0_only=None):
        """Call `method_name(*args)` on every rank's ModelRunner (the workers first: rank 0 waits for
        them in its collectives) and return rank 0's result. rank0_only: one more argument, for rank 0
        alone (the workers get None): structured outputs' masks."""
        extra = () if rank0_only is None else (rank0_only,)
        self._cut_short = bool(self.workers.processes)
        self.workers.send(method_name, args + (None,) * len(extra))
        result = getattr(self.model_runner, method_name)(*args, *extra)
        self._cut_short = False
        return result

    # ---- requests -------------------------------------------------------------------------------------
    def _make_sequence(self, prompt: str | list[int], sampling_params: SamplingParams) -> Sequence:
        """Check one request in full, without touching any engine state."""
        token_ids = checked_request(self.tokenizer, prompt, sampling_params, self.limits)
        return self._new_sequence(token_ids, sampling_params)

    def _new_sequence(self, token_ids: list[int], sampling_params: SamplingParams) -> Sequence:
        seq = Sequence(token_ids, sampling_params, self.config.kvcache_block_size)
        if sampling_params.structured_outputs is not None:     # its grammar compiled (once per distinct text)
            seq.grammar = self.structured_outputs.new_state(sampling_params.structured_outputs, token_ids)
        return seq

    def check_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> None:
        """Raise (ValueError or TypeError, naming the problem) where generate() would refuse this request."""
        self._make_sequence(prompt, sampling_params)

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> int:
        """Check the request and queue it; returns its id (its first sequence's), which the step's
        `updates` carry."""
        seq = self._make_sequence(prompt, sampling_params)
        self.scheduler.add(seq)
        return seq.seq_id

    def add_checked_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> int:
        """Queue a request that was checked at the edge it entered by (AsyncLLM.check_request)."""
        seq = self._new_sequence(prompt_token_ids, sampling_params)
        self.scheduler.add(seq)
        return seq.seq_id

    def finish_completion(self, request_id: int, index: int, finish_reason: str = "stop") -> bool:
        """Stop computing completion `index` of a request (a stop string ended its text). Returns False
        if it had ended already."""
        seq = self.scheduler.find(request_id, index)
        if seq is None:
            return False
        seq.finish_reported = True      # its end is the caller's news: no update says it again
        self.scheduler.finish(seq, finish_reason)
        self._ended_seq_ids.append(seq.seq_id)
        return True

    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """Schedule and launch one batch, then collect the batch launched before it: the device runs
        one step while the host prepares the next. Returns finished (seq_id, completion token ids) and
        the tokens launched (positive for prefill, negative for decode: the tqdm bar tells them apart)."""
        finished, num_tokens = self._step()
        return [(seq.seq_id, seq.completion_token_ids) for seq in finished], num_tokens

    def _step(self) -> tuple[list[Sequence], int]:
        self.workers.check()
        if self._cut_short:
            raise RuntimeError("a step was interrupted midway, so the tensor-parallel ranks may be out of "
                               "step; exit() this engine and build a new one")
        try:
            return self._step_and_collect()
        except Exception as error:
            self.workers.explain(error)     # a collective failed because a worker died: say so
            raise

    def _step_and_collect(self) -> tuple[list[Sequence], int]:
        if self.spec_decode is None:
            return self._pipelined_step()
        running = self.scheduler.running
        speculate = self._drained or self.spec_decode.policy.speculate(len(running))
        self._drained = False
        if speculate and self._in_flight is not None and self.spec_decode.may_propose(running):
            # drafts follow every token so far: collect the step in flight first
            previous, self._in_flight = self._in_flight, None
            self.updates = []
            self._drained = True        # the next step speculates, as decided here
            return self._collect(previous), 0
        had_in_flight = self._in_flight is not None
        accepted_before = self.spec_decode.num_accepted_tokens
        start = perf_counter()
        # with a step in flight and nothing to draft from, the next is launched beside it, as plain decoding does
        finished, num_tokens = self._step_in_lockstep() if speculate and not had_in_flight \
            else self._pipelined_step()
        # a decode step's tokens a second, for the policy: a step that collected nothing is not one
        if num_tokens < 0 and (had_in_flight or self._in_flight is None):
            emitted = -num_tokens + self.spec_decode.num_accepted_tokens - accepted_before
            self.spec_decode.policy.record(-num_tokens, speculate, emitted, perf_counter() - start)
        return finished, num_tokens

    def _launch(self, seqs: list[Sequence], is_prefill: bool, constrained: bool = False) -> tuple[tuple, int]:
        """Run one scheduled step on every rank: (what _collect takes, the tokens launched: positive for
        prefill, negative for decode). `constrained`: the forward pass only, sampled once the masks are known."""
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
        prompt_rows = self._prompt_logprob_rows(seqs) if is_prefill else []
        sampled = self._call("run", seqs, is_prefill, self.scheduler.block_copies, self._ended_seq_ids,
                             prompt_rows, constrained, self.scheduler.prefix_copies)
        self._ended_seq_ids = []
        return (self.scheduler.launched(seqs), sampled, [seqs[i] for i, _ in prompt_rows]), num_tokens

    def _pipelined_step(self, scheduled: tuple[list[Sequence], bool] | None = None) -> tuple[list[Sequence], int]:
        """Launch the next step (`scheduled`, or what the scheduler gives now) and collect the one in flight."""
        seqs, is_prefill = scheduled or self.scheduler.schedule()
        launched, num_tokens, constrained = None, 0, False
        if seqs:
            # constrained sequences: the forward pass now, the sampling once the masks are known (below)
            constrained = any(seq.grammar is not None for seq in seqs)
            launched, num_tokens = self._launch(seqs, is_prefill, constrained)
        elif self._in_flight is None:
            raise RuntimeError("the scheduler could schedule nothing although requests are pending")
        previous, self._in_flight = self._in_flight, launched
        self.updates = []
        finished = self._collect(previous) if previous is not None else []
        if constrained:   # the grammars have the previous step's tokens: mask and sample this one
            self._in_flight = (launched[0], self._sample_deferred(seqs), launched[2])
        return finished, num_tokens

    def _step_in_lockstep(self) -> tuple[list[Sequence], int]:
        """Speculative decoding with nothing in flight: a decode step whose sequences carry drafts verifies
        them and is collected at once (how many are accepted decides where the next one writes;
        spec_decode.py); any other step is launched as usual and left in flight."""
        seqs, is_prefill = self.scheduler.schedule()
        self.updates = []
        if not seqs:
            raise RuntimeError("the scheduler could schedule nothing although requests are pending")
        drafts = None if is_prefill else self.spec_decode.propose(seqs)
        if drafts is None or not any(drafts):
            # nothing to verify: left in flight, so that the next step may be launched beside it (or collects
            # it first, where drafts may follow)
            return self._pipelined_step((seqs, is_prefill))
        constrained = any(seq.grammar is not None for seq in seqs)
        token_bitmask = self.structured_outputs.verify_bitmask(seqs, drafts) if constrained else None
        sampled, accepted = self._call("verify", seqs, drafts, self._ended_seq_ids, rank0_only=token_bitmask)
        self._ended_seq_ids = []
        token_ids, logprobs = sampled.tolist(), sampled.logprobs()
        num_accepted = accepted.tolist() if accepted is not None else count_accepted(token_ids, drafts)
        self.workers.check()       # an NCCL step broken off by a worker's death returns garbage
        finished = self.spec_decode.accept(seqs, drafts, token_ids, num_accepted, logprobs)
        self._ended_seq_ids.extend(seq.seq_id for seq in finished)
        self.updates = completion_updates(seqs)
        return finished, -len(seqs)

    def _sample_deferred(self, seqs: list[Sequence]):
        """Sample the launched step with its structured outputs' masks (rank 0 alone needs them)."""
        return self._call("sample_deferred", rank0_only=self.structured_outputs.bitmask(seqs))

    def _collect(self, previous) -> list[Sequence]:
        """The tokens of the step launched before: log-probs, finishes, and the updates they make."""
        awaiting, sampled, prompt_seqs = previous
        token_ids = sampled.tolist()
        logprobs = sampled.logprobs()
        self.workers.check()       # an NCCL step broken off by a worker's death returns garbage
        if logprobs is not None:
            record_logprobs(awaiting, token_ids, logprobs)
        if prompt_seqs:
            record_prompt_logprobs(prompt_seqs, *sampled.prompt_logprobs())
        finished = self.scheduler.postprocess(awaiting, token_ids)
        self._ended_seq_ids.extend(seq.seq_id for seq in finished)
        self.updates = completion_updates(awaiting)
        return finished

    @staticmethod
    def _prompt_logprob_rows(seqs: list[Sequence]) -> list[tuple[int, int]]:
        """(row, k) of the sequences whose prompt positions this prefill computes and which want their
        prompt's log-probs."""
        return [(i, seq.sampling_params.prompt_logprobs) for i, seq in enumerate(seqs)
                if seq.prompt_logprobs is not None and seq.num_scheduled_tokens
                and seq.num_cached_tokens < seq.num_prompt_tokens - 1]

    def abort_request(self, first_seq_id: int) -> list:
        """Drop every sequence of the request whose first sequence is first_seq_id, wherever it is, and
        free its blocks now (between steps: a step in flight skips what is finished). Returns them."""
        dropped = self.scheduler.abort([first_seq_id])
        self._ended_seq_ids.extend(seq.seq_id for seq in dropped)
        return dropped

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self._in_flight is None

    @property
    def stats(self) -> dict:
        spec = self.spec_decode.stats() if self.spec_decode is not None else {}
        return {**self.scheduler.stats(), **spec}

    def generate(self, prompts: str | dict | list[str] | list[list[int]] | list[dict],
                 sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True) -> list[dict]:
        """Run every prompt to completion; outputs ({"text", "token_ids"}) come back in input order. A prompt
        is text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}; one alone (text or dict)
        is a list of one."""
        if self._exited:
            raise RuntimeError("this engine has exited")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, list):
            raise TypeError(f"prompts must be a list of str, token-id lists or prompt dicts, got "
                            f"{type(prompts).__name__}")
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            raise TypeError("prompts is a flat list of ints: one token-id prompt goes in a list of its own, "
                            "[[id, id, ...]], or as {\"prompt_token_ids\": [...]}")
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        elif len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        if not seqs:
            return []
        processor = OutputProcessor(self.tokenizer)
        for seq in seqs:
            processor.add_request(seq.seq_id, seq.prompt_token_ids, seq.sampling_params, stream=False)
            self.scheduler.add(seq)
        outputs: dict[int, dict] = {}
        pbar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_throughput = decode_throughput = 0.0
        try:
            while not self.is_finished():
                t = perf_counter()
                _, num_tokens = self._step()
                touched, stopped = processor.process(self.updates)
                for request_id, index in stopped:
                    self.finish_completion(request_id, index)
                elapsed = perf_counter() - t
                if num_tokens > 0:
                    prefill_throughput = num_tokens / elapsed
                elif num_tokens < 0:
                    decode_throughput = -num_tokens / elapsed
                if use_tqdm:
                    stats = self.stats
                    pbar.set_postfix(prefill=f"{int(prefill_throughput)}tok/s",
                                     decode=f"{int(decode_throughput)}tok/s",
                                     hit=f"{stats['prefix_cache_hit_rate']:.0%}", preempt=stats["num_preemptions"])
                for request_id in touched:
                    if processor.is_finished(request_id):
                        outputs[request_id] = processor.take(request_id).output
                        pbar.update(1)
        except BaseException:
            self._in_flight = None
            self._ended_seq_ids.extend(seq.seq_id for seq in self.scheduler.abort_all())
            raise
        finally:
            pbar.close()
        return [outputs[seq.seq_id] for seq in seqs]

