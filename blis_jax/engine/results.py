"""Result codes of a simulation run (a bit set; 0 = success).

A capacity overflow inside jit stops the loop and sets its bit; the host driver then retries
with larger buffers or reports the code. Data is never silently dropped.
"""

OK = 0
ROWS_FULL = 1 << 0  # more preempted requests waiting than preempted_slots
FREE_RING_FULL = 1 << 1  # released-block FIFO could not be compacted enough
WAIT_WINDOW_FULL = 1 << 2  # priority wait window full
ALLOC_OVERFLOW = 1 << 3  # one allocation needed more than alloc_blocks blocks
WINDOW_FULL = 1 << 6  # requests in flight span more than `window` enqueue positions
STEP_LOG_FULL = 1 << 7  # more steps since the last host read than the step log holds
RUN_LOG_FULL = 1 << 8  # more gap-closed decode runs since the last host read than the run log holds
INBOX_FULL = 1 << 9  # more routed requests awaiting their enqueue at one instance than the inbox holds
TRANSFERS_FULL = 1 << 10  # PD cluster: more KV transfers in flight (or unread completions) than held
GATEWAY_FULL = 1 << 11  # flow control: more requests queued at the gateway (or awaiting routing) than held
BATCH_FULL = 1 << 12  # the running batch filled its slots while max-num-seqs allowed more (dims.batch_slots)
SCALING_FULL = 1 << 13  # autoscaler: more pending actuations, delay draws or log lines than held
INSTANCE_SLOTS_FULL = 1 << 14  # autoscaler: it created more instances than the compiled slots (driver regrows)
OFFLOAD_FULL = 1 << 15  # KV offload chain: more I/O jobs pending, or jitter draws used, than held

_NAMES = {
    ROWS_FULL: "rows_full",
    FREE_RING_FULL: "free_ring_full",
    WAIT_WINDOW_FULL: "wait_window_full",
    ALLOC_OVERFLOW: "alloc_overflow",
    WINDOW_FULL: "window_full",
    STEP_LOG_FULL: "step_log_full",
    RUN_LOG_FULL: "run_log_full",
    INBOX_FULL: "inbox_full",
    TRANSFERS_FULL: "transfers_full",
    GATEWAY_FULL: "gateway_full",
    BATCH_FULL: "batch_full",
    SCALING_FULL: "scaling_full",
    INSTANCE_SLOTS_FULL: "instance_slots_full",
    OFFLOAD_FULL: "offload_full",
}

GROWABLE = (ROWS_FULL | FREE_RING_FULL | WAIT_WINDOW_FULL | WINDOW_FULL | STEP_LOG_FULL | RUN_LOG_FULL
            | INBOX_FULL | TRANSFERS_FULL | GATEWAY_FULL | BATCH_FULL | SCALING_FULL)


def growable(state) -> int:
    """The bits that stop an instance's loop for a rerun: GROWABLE, and OFFLOAD_FULL with an offload
    chain (a separate constant so that programs without one stay as they were)."""
    return GROWABLE | OFFLOAD_FULL if getattr(state, "off", None) is not None else GROWABLE


def describe(code: int) -> str:
    if code == OK:
        return "ok"
    return "|".join(name for bit, name in _NAMES.items() if code & bit)


# What to change when a code survives the driver's buffer growth (64-fold): the load is beyond
# what the compiled capacities were planned for, so the advice is about the scenario.
_FIXES = {
    ROWS_FULL: "more requests were preempted at once than the engine can hold; the KV cache is far too small "
               "for the load: raise the KV blocks or lower the arrival rate",
    FREE_RING_FULL: "KV blocks were released faster than the engine can recycle them: raise the block size "
                    "in tokens",
    WAIT_WINDOW_FULL: "the wait queue outgrew its window: the load exceeds the instance's capacity by far; "
                      "lower the rate, add instances or set a horizon",
    ALLOC_OVERFLOW: "one request needed more KV blocks in a single step than planned: raise the block size in "
                    "tokens or cap the prompt length (max-model-len)",
    WINDOW_FULL: "more requests were in flight at once than planned: lower the rate, add instances or set "
                 "a horizon",
    STEP_LOG_FULL: "more engine steps between host reads than the step log holds: lower events_per_chunk",
    RUN_LOG_FULL: "more decode runs between host reads than the run log holds: lower events_per_chunk",
    INBOX_FULL: "more routed requests waited at one instance than planned: add instances or lower the "
                "routing latency or the rate",
    TRANSFERS_FULL: "more KV transfers were in flight than planned: raise the transfer bandwidth or lower "
                    "the rate",
    GATEWAY_FULL: "more requests waited at the gateway than planned: set a gateway queue depth limit or a "
                  "request TTL, or lower the rate",
    BATCH_FULL: "the running batch outgrew its planned slots: lower max-num-seqs",
    SCALING_FULL: "the autoscaler actuated more often than planned: raise the "
                  "stabilization windows or the tick interval, or set a horizon",
    INSTANCE_SLOTS_FULL: "the autoscaler created more instances than planned: raise the stabilization windows or "
                         "the tick interval, or set a horizon",
    OFFLOAD_FULL: "more KV offload transfers were pending than planned: raise the secondary tiers' bandwidths "
                  "or threads, or lower the rate",
}


def fix(code: int) -> str:
    """What to change in the scenario for each overflow bit of `code` ("" for OK)."""
    return "; ".join(f"{_NAMES[bit]}: {advice}" for bit, advice in _FIXES.items() if code & bit)
