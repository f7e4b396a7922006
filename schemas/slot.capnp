# The header the single writer of a channel stores in front of every slot payload.
# Evolution rule: add fields and union members only at new ordinals; never renumber.
@0xb35799bdb137f8a1;

using T = import "tensor.capnp";
using F = import "frame.capnp";
using R = import "receipt.capnp";

const schemaVersion :UInt16 = 1;

enum Domain {
  unknown @0;
  control @1;
  research @2;
  supervisor @3;
}

# Per-message stamp, written by the channel's single writer for every publish.
struct SlotHeader {
  schemaVersion @0 :UInt16;
  channelId @1 :UInt32;
  sequence @2 :UInt64;      # strictly increasing per channel (across writer restarts), from 1
  generation @3 :UInt64;    # the slot's seqlock value while this header is valid
  writerPid @4 :UInt32;
  writerDomain @5 :Domain;
  publishTsNs @6 :UInt64;   # CLOCK_MONOTONIC when the writer published
  payloadCrc :union {
    none @7 :Void;
    crc32 @8 :UInt32;       # zlib CRC-32 over the tensor's byte span, when the channel asks
  }
  frame :union {
    none @9 :Void;
    meta @10 :F.FrameMeta;
  }
  # Model outputs carry the receipt of the inference that produced them (null otherwise).
  receipt @11 :R.Receipt;
}

# What is in the slot and how to view it. A stream reuses the same layout bytes, so a
# reader caches the validated result keyed by these exact bytes.
struct SlotLayout {
  schemaVersion @0 :UInt16;
  tensor @1 :T.TensorDesc;
  frame :union {
    none @2 :Void;
    format @3 :F.FrameFormat;
  }
}
