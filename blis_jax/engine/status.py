"""Request status codes: one enumeration for the engine's arrays and the outputs.

NOT_ARRIVED is 0 so that a zero-initialised array means "not injected yet" (e.g. an arrival
past the horizon); the codes up to RUNNING are the unfinished ones (tests rely on the order).
"""

NOT_ARRIVED = 0     # not yet enqueued at an instance
QUEUED = 1          # in a wait queue (never admitted, or preempted and waiting again)
RUNNING = 2         # in a running batch
COMPLETED = 3
LENGTH_CAPPED = 4   # force-completed at max_model_len − 1: a completion in every BLIS count
TIMED_OUT = 5       # cancelled at its deadline
DROPPED = 6         # unservable at enqueue (max_model_len / KV capacity guards)
REJECTED = 7        # refused by cluster admission (never reached an instance)
# flow control (cluster/gateway.py): outcomes at the gateway queue, before any instance
GATEWAY_QUEUED = 8  # still in the gateway queue when the run stopped
GATEWAY_REJECTED = 9  # refused by the gateway queue (band or queue full)
GATEWAY_SHED = 10  # queued, then shed for a more important request
GATEWAY_EXPIRED = 11  # queued longer than --request-ttl
ROUTING_REJECTED = 12  # admitted, but no routable instance serves its model (never reached an instance)
ENCODE_REJECTED = 13  # admitted, its encode decider fired, and no routable encode instance (E/P/D)

STATUS_NAMES = {NOT_ARRIVED: "not_arrived", QUEUED: "queued", RUNNING: "running",
                COMPLETED: "completed", LENGTH_CAPPED: "length_capped", TIMED_OUT: "timed_out",
                DROPPED: "dropped", REJECTED: "rejected", GATEWAY_QUEUED: "gateway_queued",
                GATEWAY_REJECTED: "gateway_rejected", GATEWAY_SHED: "gateway_shed",
                GATEWAY_EXPIRED: "gateway_expired",
                ROUTING_REJECTED: "routing_rejected", ENCODE_REJECTED: "encode_routing_rejected"}
