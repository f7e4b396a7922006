# Tensor descriptor shared by every channel: enough to rebuild a zero-copy,
# DLPack-compatible view of bytes in a shared-memory slot.
@0xd4956f279458c639;

# DLPack DLDataTypeCode values (dlpack.h), so the mapping is one-to-one.
enum DTypeCode {
  int @0;
  uint @1;
  float @2;
  opaqueHandle @3;
  bfloat @4;
  complex @5;
  bool @6;
}

struct DType {
  code @0 :DTypeCode;
  bits @1 :UInt8;
  lanes @2 :UInt16 = 1;
}

# DLPack DLDeviceType values.
enum DeviceType {
  unknown @0;
  cpu @1;
  cuda @2;
  cudaHost @3;
  openCl @4;
  reserved5 @5;  # DLPack 5/6 are unassigned
  reserved6 @6;
  vulkan @7;
  metal @8;
}

struct Device {
  type @0 :DeviceType = cpu;
  id @1 :Int32;
}

struct TensorDesc {
  dtype @0 :DType;
  shape @1 :List(UInt64);
  # Strides in BYTES (numpy convention). DLPack wants elements, so a reader
  # requires every stride and the byte offset to be a multiple of the item size.
  strides @2 :List(Int64);
  # Offset of element [0,...,0] from the start of the slot payload.
  byteOffset @3 :UInt64;
  # Bytes the writer says the tensor spans; checked against shape/strides.
  nbytes @4 :UInt64;
  device @5 :Device;
}
