# The header the single writer of a channel stores in front of every slot payload.
# Evolution rule: add fields and union members only at new ordinals; never renumber.
@0xb35799bdb137f8a1;

using T = import "tensor.capnp";
using F = import "frame.capnp";

const schemaVersion :UInt16 = 1;

enum Domain {
  unknown @0;
  control @1;
  research @2;
  supervisor @3;
}

struct SlotHeader {
  schemaVersion @0 :UInt16;
  channelId @1 :UInt32;
  sequence @2 :UInt64;      # strictly increasing per channel, starts at 1
  generation @3 :UInt64;    # the slot's seqlock value while this header is valid
  writerPid @4 :UInt32;
  writerDomain @5 :Domain;
  publishTsNs @6 :UInt64;   # CLOCK_MONOTONIC
  payloadCrc :union {
    none @7 :Void;
    crc32 @8 :UInt32;       # zlib CRC-32 over the tensor's byte span, when the channel asks
  }
  tensor @9 :T.TensorDesc;
  meta :union {
    none @10 :Void;
    frame @11 :F.FrameMeta;
  }
}
