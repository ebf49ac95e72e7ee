"""--simulated-delay inside Megatron's training loop: Megatron's own schedule run at the
weights of K steps ago (PP=1), the one-step-delay reference 2bw must equal."""

from __future__ import annotations

from megatron_async.megatron_lm.adapter.runtime import DelayedRun


class SimulatedDelayRun(DelayedRun):
    """--simulated-delay K: Megatron's own schedule run at the weights of K steps ago (PP=1),
    per would-be stage with --simulated-delay D0,...,DP-1; the reference 2bw must equal."""

    @classmethod
    def build(cls, args, mode, model_chunks, make_optimizer) -> "SimulatedDelayRun":
        return cls(args, mode, model_chunks, make_optimizer())

    def __init__(self, args, mode, model_chunks, optimizer):
        from megatron_async.stash.delay_reference import version_for_step

        super().__init__(args, model_chunks, optimizer, depth=mode.stash_depth)
        delays = mode.stage_delays or (mode.simulated_delay,)
        self.version_for = version_for_step(model_chunks, self.stash, delays, args.num_layers)
        self.started = False  # the stash starts from the loaded weights at the first step

    def forward_backward_func(self, forward_backward):
        """Megatron's schedule `forward_backward`, run at the delayed weights of each iteration."""

        def run(*, model, forward_only=False, **kwargs):
            stash = self.stash
            if forward_only:
                stash.point_to(stash.newest)
                return forward_backward(model=model, forward_only=True, **kwargs)
            args = self.args
            if not self.started:  # after Megatron loaded the checkpoint, before the first step
                self.start_from_checkpoint(args)
                self.started = True
            # Megatron's schedule runs the whole batch between two steps: no saved-tensor hooks needed
            with stash.use(self.version_for(args.curr_iteration), hooks=False):
                return forward_backward(model=model, **kwargs)

        return run
