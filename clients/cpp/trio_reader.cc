// A C++ reader of one trio-bridge channel, attached the way a sandboxed worker is:
// the supervisor puts the channel's reader handle (JSON) in TRIO_BRIDGE_<CHANNEL> and
// passes its fds (segment read-only, own lease table read-write, own wake-up socket).
//
//   trio_reader CHANNEL COUNT [TIMEOUT_MS]
//
// Prints {"ready": pid} once attached, then one JSON line per message:
//   {"seq":..,"frame_id":..,"crc32":"xxxxxxxx","nbytes":..,"dtype":"uint8","shape":[..]}
// (crc32 = zlib CRC-32 of the tensor's bytes in C order, so a test compares it with
// the writer's bytes), or {"seq":..,"rejected":"reason"} for a message that fails a
// check. A bad handle or environment is one line on stderr and exit 2.
//
// The SlotHeader and SlotLayout are read and checked with the code `capnp compile
// -oc++` generates from schemas/*.capnp. The memory ordering is the bridge's (written
// out in supervisor/ipc/_native.c): acquire loads of last_seq and of each generation,
// the lease published with a release store and a full fence, an acquire fence before
// the generation is loaded again after reading (the seqlock's end).
#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/array.h>
#include <kj/exception.h>

#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "slot.capnp.h"

namespace {

// ---------------------------------------------------------------- the bridge's layout
// (supervisor/ipc/_geometry.py and layout.py)
constexpr uint64_t PAGE = 4096, HEADER_AREA = 4096, HEADER_MAX = 2048, LAYOUT_OFFSET = 2048,
                   LAYOUT_MAX = HEADER_AREA - LAYOUT_OFFSET, CONTROL_SIZE = 64;
constexpr uint64_t MAGIC = 0x314752424F495254ull;        // "TRIOBRG1"
constexpr uint64_t LEASE_MAGIC = 0x31455341454C4254ull;  // "TBLEASE1"
constexpr uint32_t LAYOUT_VERSION = 1;
constexpr uint64_t OFF_LAST_SEQ = 48, OFF_LAST_SLOT = 56, LEASE_BASE = 64, LEASE_STRIDE = 32;
constexpr uint64_t FUTURE_TOLERANCE_NS = 5000000;

uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "trio_reader: %s\n", what.c_str());
  std::exit(2);
}

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

// ---------------------------------------------------------------- the handle (JSON)
// The supervisor writes it (channel.ReaderHandle.to_json): an object whose keys are
// unique across its one nesting level, so a key scan is enough. Values are checked.
struct Handle {
  std::string name, dtype, kind;
  uint64_t slot_size = 0, slot_count = 0, max_leases = 0, lease_ms = 0, max_age_ms = 0,
           channel_id = 0;
  bool crc = false;
  int data_fd = -1, lease_fd = -1, event_fd = -1;
};

const char* find_value(const std::string& j, const char* key) {
  std::string k = std::string("\"") + key + "\"";
  size_t at = j.find(k);
  if (at == std::string::npos) return nullptr;
  at += k.size();
  while (at < j.size() && (j[at] == ' ' || j[at] == ':')) at++;
  return at < j.size() ? j.c_str() + at : nullptr;
}

uint64_t json_uint(const std::string& j, const char* key, uint64_t max) {
  const char* v = find_value(j, key);
  if (!v || *v < '0' || *v > '9') die(std::string("handle: '") + key + "' missing or not a number");
  errno = 0;
  char* end;
  unsigned long long x = std::strtoull(v, &end, 10);
  if (errno || x > max) die(std::string("handle: '") + key + "' out of range");
  return x;
}

std::string json_str(const std::string& j, const char* key) {
  const char* v = find_value(j, key);
  if (!v || *v != '"') die(std::string("handle: '") + key + "' missing or not a string");
  const char* e = std::strchr(v + 1, '"');
  if (!e) die(std::string("handle: '") + key + "' unterminated");
  return std::string(v + 1, e);
}

bool json_bool(const std::string& j, const char* key) {
  const char* v = find_value(j, key);
  if (v && !std::strncmp(v, "true", 4)) return true;
  if (v && !std::strncmp(v, "false", 5)) return false;
  die(std::string("handle: '") + key + "' missing or not true/false");
}

Handle parse_handle(const std::string& j) {
  Handle h;
  if (json_str(j, "role") != "reader") die("handle is not a reader handle");
  h.name = json_str(j, "name");
  h.dtype = json_str(j, "dtype");
  h.kind = json_str(j, "kind");
  h.slot_size = json_uint(j, "slot_size", 1ull << 30);
  h.slot_count = json_uint(j, "slot_count", 1024);
  h.max_leases = json_uint(j, "max_leases", 16);
  h.lease_ms = json_uint(j, "lease_ms", 1ull << 32);
  h.max_age_ms = json_uint(j, "max_age_ms", 1ull << 32);
  h.channel_id = json_uint(j, "channel_id", 0xFFFFFFFFull);
  h.crc = json_bool(j, "crc");
  h.data_fd = int(json_uint(j, "data_fd", 1 << 20));
  h.lease_fd = int(json_uint(j, "lease_fd", 1 << 20));
  h.event_fd = int(json_uint(j, "event_fd", 1 << 20));
  if (h.slot_size == 0 || h.slot_count < 2 || h.max_leases == 0) die("handle: bad spec");
  return h;
}

// DLPack (code, bits) of the channel's dtype (supervisor/ipc/_types.py).
bool dlpack_of(const std::string& dt, unsigned& code, unsigned& bits) {
  struct E { const char* n; unsigned c, b; };
  static const E table[] = {{"bool", 6, 8},    {"int8", 0, 8},    {"int16", 0, 16},
                            {"int32", 0, 32},  {"int64", 0, 64},  {"uint8", 1, 8},
                            {"uint16", 1, 16}, {"uint32", 1, 32}, {"uint64", 1, 64},
                            {"float16", 2, 16}, {"float32", 2, 32}, {"float64", 2, 64}};
  for (const E& e : table)
    if (dt == e.n) { code = e.c; bits = e.b; return true; }
  return false;
}

// ---------------------------------------------------------------- CRC-32 (zlib's)
uint32_t crc_table[256];
void crc_init() {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    crc_table[i] = c;
  }
}
uint32_t crc_update(uint32_t crc, const uint8_t* p, size_t n) {
  crc = ~crc;
  while (n--) crc = crc_table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

// ---------------------------------------------------------------- ordered accesses
inline uint64_t load_acquire(const uint8_t* p) {
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(p), __ATOMIC_ACQUIRE);
}
inline uint64_t load_relaxed(const uint8_t* p) {
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(p), __ATOMIC_RELAXED);
}
inline uint32_t load32(const uint8_t* p) {
  return __atomic_load_n(reinterpret_cast<const uint32_t*>(p), __ATOMIC_RELAXED);
}
inline void store_release(uint8_t* p, uint64_t v) {
  __atomic_store_n(reinterpret_cast<uint64_t*>(p), v, __ATOMIC_RELEASE);
}
inline void store_relaxed(uint8_t* p, uint64_t v) {
  __atomic_store_n(reinterpret_cast<uint64_t*>(p), v, __ATOMIC_RELAXED);
}

struct Rejected { std::string reason, detail; };

struct Tensor {
  std::vector<uint64_t> shape;
  std::vector<int64_t> strides;
  uint64_t offset = 0, item = 0, nbytes = 0;
};

// ---------------------------------------------------------------- the channel
class Channel {
 public:
  explicit Channel(const Handle& h) : h_(h) {
    if (!dlpack_of(h.dtype, code_, bits_)) die("handle: unknown dtype '" + h.dtype + "'");
    ctl_size_ = round_up(PAGE + CONTROL_SIZE * h.slot_count, PAGE);
    stride_ = HEADER_AREA + round_up(h.slot_size, PAGE);
    size_ = ctl_size_ + h.slot_count * stride_;
    struct stat st;
    if (fstat(h.data_fd, &st) != 0) die("segment fd " + std::to_string(h.data_fd) + ": " + std::strerror(errno));
    if (uint64_t(st.st_size) != size_)
      die("segment is " + std::to_string(st.st_size) + " bytes, spec says " + std::to_string(size_));
    void* m = mmap(nullptr, size_, PROT_READ, MAP_SHARED, h.data_fd, 0);
    if (m == MAP_FAILED) die(std::string("mmap segment: ") + std::strerror(errno));
    seg_ = static_cast<const uint8_t*>(m);
    void* l = mmap(nullptr, PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, h.lease_fd, 0);
    if (l == MAP_FAILED) die(std::string("mmap lease table: ") + std::strerror(errno));
    lease_ = static_cast<uint8_t*>(l);
  }

  void attach(uint64_t timeout_ms) {
    uint64_t end = now_ns() + timeout_ms * 1000000ull;
    while (load_acquire(seg_) != MAGIC) {   // the writer's release store of the magic
      if (now_ns() > end) die("no writer attached to channel '" + h_.name + "'");
      usleep(5000);
    }
    uint32_t version, count, ctl_words, chan;
    uint64_t size, stride, ctl;
    std::memcpy(&version, seg_ + 8, 4);
    std::memcpy(&count, seg_ + 12, 4);
    std::memcpy(&size, seg_ + 16, 8);
    std::memcpy(&stride, seg_ + 24, 8);
    std::memcpy(&ctl, seg_ + 32, 8);
    std::memcpy(&chan, seg_ + 40, 4);
    (void)ctl_words;
    if (version != LAYOUT_VERSION || count != h_.slot_count || size != h_.slot_size ||
        stride != stride_ || ctl != ctl_size_ || chan != h_.channel_id)
      die("segment header of channel '" + h_.name + "' does not match the spec");
    // This reader is the only writer of its lease table: start it clean.
    std::memset(lease_, 0, PAGE);
    store_relaxed(lease_ + 0, LEASE_MAGIC);
    uint64_t pid_leases = uint64_t(uint32_t(getpid())) | (h_.max_leases << 32);
    store_relaxed(lease_ + 8, pid_leases);
    uint64_t latest = load_acquire(seg_ + OFF_LAST_SEQ);
    last_seq_ = latest ? latest - 1 : 0;   // start at the newest message, not history
  }

  // Block for the next message and print its line; false on timeout.
  bool next(int timeout_ms) {
    uint64_t end = now_ns() + uint64_t(timeout_ms) * 1000000ull;
    for (;;) {
      if (take()) return true;
      uint64_t now = now_ns();
      if (now >= end) return false;
      pollfd p{h_.event_fd, POLLIN, 0};
      int left = int((end - now) / 1000000ull) + 1;
      if (poll(&p, 1, left) > 0) {
        char buf[4096];
        while (read(h_.event_fd, buf, sizeof buf) == ssize_t(sizeof buf)) {}
      }
    }
  }

 private:
  uint64_t cb(uint64_t i) const { return PAGE + CONTROL_SIZE * i; }
  uint64_t header_at(uint64_t i) const { return ctl_size_ + i * stride_; }

  bool take() {
    for (int attempt = 0; attempt < 8; attempt++) {
      uint64_t want = last_seq_ + 1;
      if (load_acquire(seg_ + OFF_LAST_SEQ) < want) return false;        // R1
      uint64_t slot = h_.slot_count, gen = 0, seq = 0;
      uint32_t hint = load32(seg_ + OFF_LAST_SLOT);
      if (hint < h_.slot_count) {
        uint64_t g = load_acquire(seg_ + cb(hint));                        // R2
        uint64_t s = load_relaxed(seg_ + cb(hint) + 8);
        if (s == want && !(g & 1)) { slot = hint; gen = g; seq = s; }
      }
      if (slot == h_.slot_count) {
        for (uint64_t i = 0; i < h_.slot_count; i++) {
          uint64_t g = load_acquire(seg_ + cb(i));                         // R2
          uint64_t s = load_relaxed(seg_ + cb(i) + 8);
          if (!(g & 1) && s >= want && (slot == h_.slot_count || s < seq)) {
            slot = i; gen = g; seq = s;
          }
        }
        if (slot == h_.slot_count) return false;
      }
      uint32_t hlen = load32(seg_ + cb(slot) + 24), llen = load32(seg_ + cb(slot) + 28);
      hlen = hlen < HEADER_MAX ? hlen : HEADER_MAX;
      llen = llen < LAYOUT_MAX ? llen : LAYOUT_MAX;
      uint8_t* e = lease_ + LEASE_BASE;                                    // lease 0
      __atomic_store_n(reinterpret_cast<uint32_t*>(e), uint32_t(slot), __ATOMIC_RELAXED);  // L1
      store_relaxed(e + 16, now_ns() + h_.lease_ms * 1000000ull);
      store_release(e + 8, gen);                                           // L2
      __atomic_thread_fence(__ATOMIC_SEQ_CST);                             // L3
      auto hdr = copy_words(seg_ + header_at(slot), hlen);                 // R3
      auto lay = copy_words(seg_ + header_at(slot) + LAYOUT_OFFSET, llen);
      __atomic_thread_fence(__ATOMIC_ACQUIRE);                             // R4
      if (load_relaxed(seg_ + cb(slot)) != gen) {                          // R5
        store_release(e + 8, 0);
        continue;   // the writer took the slot meanwhile: look again
      }
      if (seq > want && received_) dropped_ += seq - want;
      last_seq_ = seq;
      try {
        if (hlen % 8 || llen % 8)   // pycapnp (the reference) refuses partial words
          throw Rejected{"malformed", "header or layout is not whole 8-byte words"};
        accept(slot, gen, seq, hdr, lay);
      } catch (const Rejected& r) {
        std::printf("{\"seq\":%llu,\"rejected\":\"%s\",\"detail\":\"%s\"}\n",
                    (unsigned long long)seq, r.reason.c_str(), r.detail.c_str());
      }
      std::fflush(stdout);
      store_release(e + 8, 0);                                             // L4
      return true;
    }
    return false;
  }

  static kj::Array<capnp::word> copy_words(const uint8_t* p, size_t n) {
    auto words = kj::heapArray<capnp::word>((n + 7) / 8);
    if (n) std::memset(words.begin(), 0, words.size() * sizeof(capnp::word));
    std::memcpy(words.begin(), p, n);
    return words;
  }

  void accept(uint64_t slot, uint64_t gen, uint64_t seq, kj::Array<capnp::word>& hdr,
              kj::Array<capnp::word>& lay) {
    capnp::ReaderOptions opts;
    opts.traversalLimitInWords = 4096;
    opts.nestingLimit = 16;
    Tensor t;
    std::string pixfmt;
    uint64_t frame_id = 0, capture = 0, publish = 0;
    bool has_frame = false, has_crc = false;
    uint32_t crc = 0;
    try {
      // ---- SlotLayout: dtype, shape, strides, offset inside the slot; frame planes.
      capnp::FlatArrayMessageReader lm(lay.asPtr(), opts);
      auto l = lm.getRoot<SlotLayout>();
      auto td = l.getTensor();
      auto dt = td.getDtype();
      if (unsigned(dt.getCode()) != code_ || dt.getBits() != bits_ || dt.getLanes() != 1)
        throw Rejected{"dtype", "tensor dtype is not the channel's " + h_.dtype};
      if (td.getDevice().getType() != DeviceType::CPU)
        throw Rejected{"malformed", "device is not CPU shared memory"};
      auto shape = td.getShape();
      auto strides = td.getStrides();
      if (shape.size() == 0 || shape.size() > 8 || strides.size() != shape.size())
        throw Rejected{"bounds", "ndim must be 1..8 with one stride per dim"};
      t.item = bits_ / 8;
      t.offset = td.getByteOffset();
      if (t.offset > h_.slot_size || t.offset % t.item)
        throw Rejected{"bounds", "offset outside the slot or not item-aligned"};
      __int128 lo = t.offset, hi = t.offset, count = 1;
      bool empty = false;
      for (unsigned i = 0; i < shape.size(); i++) {
        uint64_t n = shape[i];
        int64_t s = strides[i];
        if (n > h_.slot_size || s % int64_t(t.item) || (s == 0 && n > 1))
          throw Rejected{"bounds", "shape/stride outside the slot"};
        t.shape.push_back(n);
        t.strides.push_back(s);
        count *= n;
        if (n == 0) empty = true;
        __int128 reach = __int128(n ? n - 1 : 0) * s;
        if (reach < 0) lo += reach; else hi += reach;
      }
      if (count * t.item > h_.slot_size) throw Rejected{"bounds", "tensor larger than the slot"};
      hi = empty ? hi : hi + t.item;
      if (lo < 0 || hi > __int128(h_.slot_size))
        throw Rejected{"bounds", "view touches bytes outside the slot payload"};
      if (td.getNbytes() != uint64_t(hi - lo)) throw Rejected{"bounds", "nbytes disagrees with the span"};
      t.nbytes = uint64_t(count) * t.item;
      if (l.getFrame().isFormat()) {
        auto f = l.getFrame().getFormat();
        static const unsigned bps_nv12[] = {1, 2};
        unsigned planes_want;
        const unsigned* bps;
        unsigned bps1 = 1;
        switch (f.getPixelFormat()) {
          case PixelFormat::NV12: pixfmt = "nv12"; planes_want = 2; bps = bps_nv12; break;
          case PixelFormat::RGB888: pixfmt = "rgb888"; planes_want = 1; bps1 = 3; bps = &bps1; break;
          case PixelFormat::BGR888: pixfmt = "bgr888"; planes_want = 1; bps1 = 3; bps = &bps1; break;
          case PixelFormat::GRAY8: pixfmt = "gray8"; planes_want = 1; bps = &bps1; break;
          default: throw Rejected{"format", "unknown pixel format"};
        }
        auto planes = f.getPlanes();
        if (planes.size() != planes_want) throw Rejected{"format", "wrong plane count"};
        for (unsigned i = 0; i < planes.size(); i++) {
          auto p = planes[i];
          __int128 end = __int128(p.getOffset()) +
                         __int128(p.getRowStride()) * (p.getHeight() ? p.getHeight() - 1 : 0) +
                         __int128(p.getWidth()) * bps[i];
          if (p.getHeight() && end > __int128(h_.slot_size))
            throw Rejected{"bounds", "frame plane outside the slot"};
          if (uint64_t(p.getWidth()) * bps[i] > p.getRowStride())
            throw Rejected{"format", "plane rows overlap"};
        }
      }
      // ---- SlotHeader: version, channel, the control block's seq/gen, CRC, frame.
      capnp::FlatArrayMessageReader hm(hdr.asPtr(), opts);
      auto s = hm.getRoot<SlotHeader>();
      if (s.getSchemaVersion() < 1) throw Rejected{"malformed", "schemaVersion 0"};
      if (s.getChannelId() != h_.channel_id) throw Rejected{"malformed", "wrong channel id"};
      if (s.getSequence() != seq || s.getGeneration() != gen)
        throw Rejected{"malformed", "header disagrees with the control block"};
      publish = s.getPublishTsNs();
      has_crc = s.getPayloadCrc().isCrc32();
      if (has_crc) crc = s.getPayloadCrc().getCrc32();
      if (h_.crc && !has_crc) throw Rejected{"malformed", "channel needs a CRC"};
      has_frame = s.getFrame().isMeta();
      if (h_.kind == "frame" && (!has_frame || pixfmt.empty()))
        throw Rejected{"malformed", "frame channel without FrameMeta/FrameFormat"};
      if (has_frame) {
        frame_id = s.getFrame().getMeta().getFrameId();
        capture = s.getFrame().getMeta().getCaptureTsNs();
      }
    } catch (const kj::Exception& e) {
      throw Rejected{"malformed", "capnp: does not decode"};
    }
    uint64_t now = now_ns();
    if (publish > now + FUTURE_TOLERANCE_NS || (has_frame && capture > now + FUTURE_TOLERANCE_NS))
      throw Rejected{"future", "timestamp ahead of this machine's clock"};
    if (has_frame && capture > publish) throw Rejected{"malformed", "captured after published"};
    uint64_t ts = has_frame ? capture : publish;
    if (h_.max_age_ms && now > ts && now - ts > h_.max_age_ms * 1000000ull)
      throw Rejected{"stale", "older than the channel's max_age"};
    // ---- The payload, in C order, then the seqlock's end (R4 + R5).
    const uint8_t* base = seg_ + header_at(slot) + HEADER_AREA;
    uint32_t c = crc_of(base, t);
    uint32_t span_crc = 0;
    if (has_crc && h_.crc) span_crc = span_crc_of(base, t);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (load_relaxed(seg_ + cb(slot)) != gen) throw Rejected{"lease_lost", "slot reused while read"};
    if (has_crc && h_.crc && span_crc != crc) throw Rejected{"crc", "payload CRC mismatch"};
    received_++;
    std::printf("{\"seq\":%llu,\"frame_id\":%llu,\"crc32\":\"%08x\",\"nbytes\":%llu,"
                "\"dtype\":\"%s\",\"pixel_format\":\"%s\",\"shape\":[",
                (unsigned long long)seq, (unsigned long long)frame_id, c,
                (unsigned long long)t.nbytes, h_.dtype.c_str(), pixfmt.c_str());
    for (size_t i = 0; i < t.shape.size(); i++)
      std::printf("%s%llu", i ? "," : "", (unsigned long long)t.shape[i]);
    std::printf("],\"dropped\":%llu}\n", (unsigned long long)dropped_);
  }

  // CRC-32 of the tensor's elements in C order (what numpy's tobytes() gives).
  static uint32_t crc_of(const uint8_t* base, const Tensor& t) {
    for (uint64_t n : t.shape)
      if (n == 0) return 0;
    std::vector<uint64_t> idx(t.shape.size(), 0);
    uint32_t c = 0;
    size_t last = t.shape.size() - 1;
    bool contiguous_rows = t.strides[last] == int64_t(t.item);
    for (;;) {
      int64_t off = int64_t(t.offset);
      for (size_t i = 0; i < last; i++) off += int64_t(idx[i]) * t.strides[i];
      if (contiguous_rows) {
        c = crc_update(c, base + off, t.shape[last] * t.item);
      } else {
        for (uint64_t k = 0; k < t.shape[last]; k++)
          c = crc_update(c, base + off + int64_t(k) * t.strides[last], t.item);
      }
      size_t d = last;
      while (d-- > 0) {
        if (++idx[d] < t.shape[d]) break;
        idx[d] = 0;
      }
      if (d == size_t(-1)) return c;
    }
  }

  // The writer's CRC: zlib CRC-32 over the tensor's byte span [lo, hi).
  static uint32_t span_crc_of(const uint8_t* base, const Tensor& t) {
    int64_t lo = int64_t(t.offset), hi = int64_t(t.offset);
    for (size_t i = 0; i < t.shape.size(); i++) {
      int64_t reach = int64_t(t.shape[i] - 1) * t.strides[i];
      if (reach < 0) lo += reach; else hi += reach;
    }
    return crc_update(0, base + lo, size_t(hi + int64_t(t.item) - lo));
  }

  Handle h_;
  unsigned code_ = 0, bits_ = 0;
  uint64_t ctl_size_ = 0, stride_ = 0, size_ = 0, last_seq_ = 0, received_ = 0, dropped_ = 0;
  const uint8_t* seg_ = nullptr;
  uint8_t* lease_ = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) die("usage: trio_reader CHANNEL COUNT [TIMEOUT_MS]");
  std::string chan = argv[1], var = "TRIO_BRIDGE_";
  for (char ch : chan) var += char(std::toupper(static_cast<unsigned char>(ch)));
  const char* json = std::getenv(var.c_str());
  if (!json) die("no handle in $" + var + " (is this process a reader of '" + chan + "'?)");
  char* end;
  long count = std::strtol(argv[2], &end, 10);
  if (*end || count < 0) die("COUNT must be a number >= 0");
  long timeout = argc > 3 ? std::strtol(argv[3], &end, 10) : 5000;
  crc_init();
  Handle h = parse_handle(json);
  Channel c(h);
  c.attach(5000);
  std::printf("{\"ready\":%d}\n", int(getpid()));
  std::fflush(stdout);
  for (long i = 0; i < count; i++)
    if (!c.next(int(timeout))) die("no message within " + std::to_string(timeout) + " ms");
  return 0;
}
