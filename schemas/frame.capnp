# Camera frame metadata: how to interpret the bytes of a frame payload.
@0xd10a9b86cc7d9501;

enum Sensor {
  unknown @0;
  road @1;
  wide @2;
  driver @3;
}

enum PixelFormat {
  unknown @0;
  nv12 @1;     # plane 0: Y (h rows), plane 1: interleaved UV (h/2 rows, w/2 pairs)
  rgb888 @2;   # one plane, 3 bytes per pixel
  gray8 @3;    # one plane, 1 byte per pixel
  bgr888 @4;
}

# Value range of the samples: full = 0..255, limited = BT.601/709 16..235 (Y) / 16..240 (C).
enum PixelRange {
  full @0;
  limited @1;
}

struct Plane {
  offset @0 :UInt64;     # bytes from the start of the slot payload
  rowStride @1 :UInt32;  # bytes between rows
  width @2 :UInt32;      # samples per row (NV12 UV plane: UV pairs)
  height @3 :UInt32;     # rows
}

# How the bytes of a frame are laid out. Constant for a stream, so it travels in the
# slot's SlotLayout and a reader validates it once per distinct layout, not per frame.
struct FrameFormat {
  sensor @0 :Sensor;
  pixelFormat @1 :PixelFormat;
  pixelRange @2 :PixelRange;
  width @3 :UInt32;
  height @4 :UInt32;
  planes @5 :List(Plane);
}

# What changes every frame; travels in the SlotHeader. The publish timestamp is
# SlotHeader.publishTsNs (one clock reading for every kind of message).
struct FrameMeta {
  frameId @0 :UInt64;
  captureTsNs @1 :UInt64;   # CLOCK_MONOTONIC at exposure end
  # Optional camera fields: absent means unknown, not zero.
  exposure :union {
    unknown @2 :Void;
    microseconds @3 :UInt32;
  }
  gain :union {
    unknown @4 :Void;
    value @5 :Float32;
  }
}
