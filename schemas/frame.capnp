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
  width @2 :UInt32;      # samples per row (UV plane: pairs)
  height @3 :UInt32;     # rows
}

struct FrameMeta {
  frameId @0 :UInt64;
  sensor @1 :Sensor;
  pixelFormat @2 :PixelFormat;
  pixelRange @3 :PixelRange;
  width @4 :UInt32;
  height @5 :UInt32;
  planes @6 :List(Plane);
  captureTsNs @7 :UInt64;   # CLOCK_MONOTONIC at exposure end
  publishTsNs @8 :UInt64;   # CLOCK_MONOTONIC when handed to the bridge
  # Optional camera fields: absent means unknown, not zero.
  exposure :union {
    unknown @9 :Void;
    microseconds @10 :UInt32;
  }
  gain :union {
    unknown @11 :Void;
    value @12 :Float32;
  }
}
