# Execution receipt: what really ran for one inference, travelling in the SlotHeader of
# the model output it produced. A device label alone proves nothing; the receipt says
# which device executed, how many bytes crossed, and when the result was on the host.
@0xc312f74fa2c797a4;

enum CompletionPoint {
  unknown @0;
  hostVisible @1;     # output bytes copied to host memory and the device synchronised
  deviceQueued @2;    # only enqueued (never used for actuation)
}

struct Receipt {
  frameId @0 :UInt64;          # the input frame consumed
  captureTsNs @1 :UInt64;      # its capture timestamp (CLOCK_MONOTONIC)
  inferStartNs @2 :UInt64;
  inferEndNs @3 :UInt64;       # at the completion point
  device @4 :Text;             # the device that really ran the kernels, e.g. "CPU"
  bytesIn @5 :UInt64;          # bytes copied host -> device for this inference
  bytesOut @6 :UInt64;         # bytes copied device -> host
  completion @7 :CompletionPoint;
  latencyNs @8 :UInt64;        # inferEnd - inferStart
  worstCaseNs @9 :UInt64;      # running worst latency since start
  deadlineNs @10 :UInt64;      # the deadline this inference was held to
  deadlineMisses @11 :UInt64;  # running count of latencies over the deadline
  artifactSha256 @12 :Data;    # sha256 of the signed manifest of the model that ran
  kernelsRun @13 :UInt32;      # kernels executed (from the captured program)
}
