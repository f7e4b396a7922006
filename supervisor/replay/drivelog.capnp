# A drive log's message stream (supervisor/replay/logfmt.py frames each Entry).
# Evolution rule: add fields and union members only at new ordinals; never renumber.
@0xe4b1c0d5a2f39a61;

using R = import "/receipt.capnp";

struct Entry {
  monoNs @0 :UInt64;            # the writer's CLOCK_MONOTONIC when it wrote the entry
  union {
    start @1 :Start;
    message @2 :ChannelMessage;
    frame @3 :FrameRecord;
    event @4 :Text;             # a lifecycle event (one JSON object)
    drops @5 :Drops;
    stop @6 :Text;              # the writer closed the log in order (a JSON summary)
  }
}

# First entry of a stream: what was recorded, and how.
struct Start {
  version @0 :UInt16;
  writer @1 :Text;              # "recorder" (a worker) or "supervisor" (lifecycle events)
  channels @2 :List(Text);
  info @3 :Text;                # JSON: config source, argv, video settings
}

# One message of a tensor channel: its header fields and its whole payload.
struct ChannelMessage {
  channel @0 :Text;
  sequence @1 :UInt64;
  publishTsNs @2 :UInt64;
  writerPid @3 :UInt32;
  hasFrameId @4 :Bool;
  frameId @5 :UInt64;
  captureTsNs @6 :UInt64;
  dtype @7 :Text;
  shape @8 :List(UInt32);
  data @9 :Data;                # C-order bytes of the tensor
  receipt @10 :R.Receipt;       # model outputs: the execution receipt (else null)
}

# One frame of a frame channel; its pixels are in the video (index `videoIndex`).
struct FrameRecord {
  channel @0 :Text;
  sequence @1 :UInt64;
  publishTsNs @2 :UInt64;
  writerPid @3 :UInt32;
  frameId @4 :UInt64;
  captureTsNs @5 :UInt64;
  exposureUs @6 :Int64;         # -1 unknown
  width @7 :UInt32;
  height @8 :UInt32;
  pixelFormat @9 :Text;
  sensor @10 :Text;
  videoIndex @11 :Int64;        # position in the channel's video; -1: not stored (dropped)
}

# What a reader missed since the previous Drops entry of the same channel.
struct Drops {
  channel @0 :Text;
  dropped @1 :UInt64;           # sequence gaps (the writer reused slots first)
  rejected @2 :UInt64;          # messages the bridge refused
  leasesLost @3 :UInt64;
  skipped @4 :UInt64;           # the recorder's own drops (it could not keep up)
}
