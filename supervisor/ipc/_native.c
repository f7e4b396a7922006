/* supervisor.ipc._native: acquire/release atomics on mmap'ed channel segments, and the
 * bridge's per-message hot path (slot choice, publish, seqlock read with lease).
 *
 * Built at `pip install -e` by setup.py with the machine's C compiler (gcc/clang, C11
 * <stdatomic.h>-equivalent __atomic builtins). Python has no fences: every access to
 * a word another process races on goes through here, so the ordering is the one the
 * C11 memory model and the hardware give, on x86-64 (TSO) and on aarch64 (weak) alike.
 *
 * ---------------------------------------------------------------------------------
 * THE MEMORY-ORDERING ARGUMENT (which store publishes what, which load acquires it)
 * ---------------------------------------------------------------------------------
 * Every shared word has exactly one writing process (the channel segment: the writer;
 * a lease table: its reader), so no read-modify-write (compare-exchange, fetch-add) is
 * needed anywhere: ordered loads, ordered stores and fences suffice. Words are 8-byte
 * aligned (layout.py), so a relaxed load or store of one is single-copy atomic.
 *
 * Slot seqlock (control block word `gen`, odd = being written, even = stable):
 *
 *   writer, loan():    W1  gen = odd            relaxed store
 *                      W2  fence(release)        orders W1 before every later store
 *   writer, fill:      W3  payload, SlotHeader, SlotLayout, control tail  (plain stores)
 *   writer, publish(): W4  gen = even           RELEASE store: publishes W3
 *                      W5  last_seq = seq       RELEASE store: publishes W4 (and W3)
 *
 *   reader, take():    R1  last_seq             ACQUIRE load (pairs with W5)
 *                      R2  g1 = gen             ACQUIRE load (pairs with W4): if even,
 *                                               everything W3 stored before it is visible
 *                      R3  copy SlotHeader/SlotLayout, later the payload (plain loads)
 *                      R4  fence(acquire)       orders R3 before R5
 *                      R5  g2 = gen             relaxed load; g2 == g1 -> R3 was stable
 *
 *   If R3 saw any byte of a later fill (W3 of the next loan), then W2 (release fence,
 *   sequenced before that store) synchronizes with R4 (acquire fence, sequenced after
 *   that load), so R5 sees at least the odd W1: g2 != g1 and the read is rejected
 *   (TornRead / LeaseLost / a silent retry). Without W2 a weak CPU may make the new
 *   bytes visible before the odd generation; without R4 it may satisfy R5 before R3.
 *   Message.check()/release(), the CRC check and Reader take() all end with R4+R5
 *   (`check` below); Message.array starts with R2 (`load`).
 *
 * Lease table (written by its reader only, mapped read-only by the writer):
 *
 *   reader, take():    L1  entry.slot, entry.deadline   relaxed stores
 *                      L2  entry.gen = g1               RELEASE store: publishes L1
 *                      L3  fence(seq_cst)               L2 before R3/R5 (store->load)
 *   reader, release:   L4  entry.gen = 0                RELEASE store (slot, deadline
 *                                                       stay: gen 0 means "empty")
 *   writer, loan():    L5  entry.gen                    ACQUIRE load (pairs with L2/L4),
 *                                                       then slot and deadline relaxed
 *
 *   A lease is the writer's advice, never what a reader's correctness rests on: the
 *   writer may have chosen the slot (W1) just before L2 became visible; then R5 (or a
 *   later check) sees the odd generation and the reader drops the message. L3 makes
 *   that window as small as the hardware allows; L2 after L1 keeps the writer from
 *   pairing a new generation with a stale slot or deadline.
 *
 * Wake-ups (eventcount, see `publish`): reader K1 awake = 0, K2 fence(seq_cst), K3 one
 * more look (R1...); writer after W5: K4 fence(seq_cst), K5 load awake, send unless set.
 * One per sleep (K6): the reader counts its sleeps (K0, before K1), the writer sends
 * no second byte for a sleep it has already sent one for.
 *
 * Channel header: the writer stores every field, then the magic with a RELEASE store
 * (`store`); a reader that sees the magic with an ACQUIRE load (`load`) sees the rest.
 * last_slot is stored (relaxed) before W5 and read (relaxed) after R1; it is only a
 * hint: the control block it names is checked (R2) before it is trusted.
 *
 * On x86-64 the acquire loads and release stores are plain MOVs and fence(acquire/
 * release) emit no instruction (TSO already orders them; the compiler barrier is what
 * they add); fence(seq_cst) is an MFENCE. On aarch64: LDAR, STLR, DMB ISHLD / DMB ISH.
 * The pure-Python fallback (memoryview "Q" words, supervisor/ipc/_atomics.py) relies on
 * TSO and is therefore only allowed on x86-64.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>
#include <structmember.h>

#define RELAXED __ATOMIC_RELAXED
#define ACQUIRE __ATOMIC_ACQUIRE
#define RELEASE __ATOMIC_RELEASE
#define SEQ_CST __ATOMIC_SEQ_CST

/* ------------------------------------------------------------------ Region */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    char *base;           /* NULL once released */
    Py_ssize_t len;
    int writable;
} Region;

static PyTypeObject RegionType;

static int region_init(Region *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"buffer", "writable", NULL};
    PyObject *obj;
    int writable = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|p", kwlist, &obj, &writable))
        return -1;
    if (self->base != NULL) {
        PyBuffer_Release(&self->view);
        self->base = NULL;
    }
    if (PyObject_GetBuffer(obj, &self->view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    if (((uintptr_t)self->view.buf) % 8) {
        PyBuffer_Release(&self->view);
        PyErr_SetString(PyExc_ValueError, "region is not 8-byte aligned");
        return -1;
    }
    self->base = self->view.buf;
    self->len = self->view.len;
    self->writable = writable;
    return 0;
}

static void region_dealloc(Region *self) {
    if (self->base != NULL)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The address of an aligned 8-byte word at `off`, or NULL with an exception set. */
static inline uint64_t *word_at(Region *r, Py_ssize_t off, int store) {
    if (r->base == NULL) {
        PyErr_SetString(PyExc_ValueError, "region released");
        return NULL;
    }
    if (off < 0 || off % 8 || off > r->len - 8) {
        PyErr_Format(PyExc_ValueError, "word offset %zd outside the %zd-byte region or "
                     "not 8-byte aligned", off, r->len);
        return NULL;
    }
    if (store && !r->writable) {
        PyErr_SetString(PyExc_ValueError, "store into a read-only region");
        return NULL;
    }
    return (uint64_t *)(r->base + off);
}

static inline int in_bounds(Region *r, Py_ssize_t off, Py_ssize_t n) {
    return r->base != NULL && off >= 0 && n >= 0 && n <= r->len && off <= r->len - n;
}

static int get_ssize(PyObject *o, Py_ssize_t *out) {
    Py_ssize_t v = PyLong_AsSsize_t(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static int get_u64(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static PyObject *region_load(Region *self, PyObject *const *args, Py_ssize_t n) {
    Py_ssize_t off;
    if (n != 1) {
        PyErr_SetString(PyExc_TypeError, "load(offset)");
        return NULL;
    }
    if (get_ssize(args[0], &off) < 0)
        return NULL;
    uint64_t *w = word_at(self, off, 0);
    if (w == NULL)
        return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(w, ACQUIRE));
}

static PyObject *region_load_relaxed(Region *self, PyObject *const *args, Py_ssize_t n) {
    Py_ssize_t off;
    if (n != 1) {
        PyErr_SetString(PyExc_TypeError, "load_relaxed(offset)");
        return NULL;
    }
    if (get_ssize(args[0], &off) < 0)
        return NULL;
    uint64_t *w = word_at(self, off, 0);
    if (w == NULL)
        return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(w, RELAXED));
}

static PyObject *store_impl(Region *self, PyObject *const *args, Py_ssize_t n, int order,
                            const char *name) {
    Py_ssize_t off;
    uint64_t v;
    if (n != 2) {
        PyErr_Format(PyExc_TypeError, "%s(offset, value)", name);
        return NULL;
    }
    if (get_ssize(args[0], &off) < 0 || get_u64(args[1], &v) < 0)
        return NULL;
    uint64_t *w = word_at(self, off, 1);
    if (w == NULL)
        return NULL;
    __atomic_store_n(w, v, order);
    Py_RETURN_NONE;
}

static PyObject *region_store(Region *self, PyObject *const *args, Py_ssize_t n) {
    return store_impl(self, args, n, RELEASE, "store");
}

static PyObject *region_store_relaxed(Region *self, PyObject *const *args, Py_ssize_t n) {
    return store_impl(self, args, n, RELAXED, "store_relaxed");
}

/* R4 + R5: everything read before this call was stable iff the word still holds `gen`. */
static PyObject *region_check(Region *self, PyObject *const *args, Py_ssize_t n) {
    Py_ssize_t off;
    uint64_t want;
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "check(offset, generation)");
        return NULL;
    }
    if (get_ssize(args[0], &off) < 0 || get_u64(args[1], &want) < 0)
        return NULL;
    uint64_t *w = word_at(self, off, 0);
    if (w == NULL)
        return NULL;
    __atomic_thread_fence(ACQUIRE);
    if (__atomic_load_n(w, RELAXED) == want)
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyObject *region_release(Region *self, PyObject *unused) {
    if (self->base != NULL) {
        PyBuffer_Release(&self->view);
        self->base = NULL;
        self->len = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *region_get_len(Region *self, void *unused) {
    return PyLong_FromSsize_t(self->len);
}

static PyMethodDef region_methods[] = {
    {"load", (PyCFunction)(void (*)(void))region_load, METH_FASTCALL,
     "load(offset) -> int: 8-byte ACQUIRE load"},
    {"load_relaxed", (PyCFunction)(void (*)(void))region_load_relaxed, METH_FASTCALL,
     "load_relaxed(offset) -> int: 8-byte relaxed (single-copy atomic) load"},
    {"store", (PyCFunction)(void (*)(void))region_store, METH_FASTCALL,
     "store(offset, value): 8-byte RELEASE store"},
    {"store_relaxed", (PyCFunction)(void (*)(void))region_store_relaxed, METH_FASTCALL,
     "store_relaxed(offset, value): 8-byte relaxed store"},
    {"check", (PyCFunction)(void (*)(void))region_check, METH_FASTCALL,
     "check(offset, generation) -> bool: acquire fence, then the word == generation"},
    {"release", (PyCFunction)region_release, METH_NOARGS,
     "drop the buffer export (the mapping can then be closed)"},
    {NULL}
};

static PyGetSetDef region_getset[] = {
    {"nbytes", (getter)region_get_len, NULL, "length of the region", NULL},
    {NULL}
};

static PyTypeObject RegionType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "supervisor.ipc._native.Region",
    .tp_basicsize = sizeof(Region),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Region(buffer, writable=False): ordered 8-byte accesses into a mapping "
              "(read-only mappings allow loads)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)region_init,
    .tp_dealloc = (destructor)region_dealloc,
    .tp_methods = region_methods,
    .tp_getset = region_getset,
};

static Region *as_region(PyObject *o, const char *what) {
    if (!PyObject_TypeCheck(o, &RegionType)) {
        PyErr_Format(PyExc_TypeError, "%s must be a Region", what);
        return NULL;
    }
    Region *r = (Region *)o;
    if (r->base == NULL) {
        PyErr_Format(PyExc_ValueError, "%s is released", what);
        return NULL;
    }
    return r;
}

/* ------------------------------------------------------------- module fences */

static PyObject *fence_acquire(PyObject *m, PyObject *unused) {
    __atomic_thread_fence(ACQUIRE);
    Py_RETURN_NONE;
}

static PyObject *fence_release(PyObject *m, PyObject *unused) {
    __atomic_thread_fence(RELEASE);
    Py_RETURN_NONE;
}

static PyObject *fence_full(PyObject *m, PyObject *unused) {
    __atomic_thread_fence(SEQ_CST);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------- the writer */

/* Lease entry layout (layout.py LEASE_ENTRY "<IxxxxQQ" at 64 + 32 k). */
#define LEASE_BASE 64
#define LEASE_STRIDE 32

/* Lease k's entry offset in lease table `lr`, or -1 when k is not one of its entries:
 * compared before it is multiplied (a k near 2**59 had wrapped onto lease 0: red team
 * 15 row 4). */
static inline Py_ssize_t lease_offset(Region *lr, Py_ssize_t k) {
    if (k < 0 || lr->base == NULL || lr->len < LEASE_BASE + LEASE_STRIDE
            || k > (lr->len - LEASE_BASE) / LEASE_STRIDE - 1)
        return -1;
    return LEASE_BASE + LEASE_STRIDE * k;
}
#define MAX_SLOTS 1024

/* loan(seg, leases, ctl, gens, seqs, loaned, now, limit, max_entries) -> (slot, honoured)
 *
 * Of the slots no live lease protects and not on loan: the newest one every reader has
 * taken already, if any (its message is nobody's to lose, and it is the one most
 * likely still in the caches: a 3.5 MB frame copied into the slot written last took
 * 154 us here, into the oldest of 8 456 us), else the oldest (smallest seq); its
 * generation becomes odd (W1, W2). slot -1: none free. "Every reader has taken":
 * seq <= the smallest TAKEN_OFF word over the lease tables of readers that attached
 * (LEASE_MAGIC at 0; each stores there the sequence number it delivered last; 0, one
 * that does not: nothing). A table no reader ever attached to (the spare reader index
 * the config adds) does not count: a reader attaching later starts at the newest
 * message, never older ones. A reader that overstates only loses its own messages: the
 * smallest counts, so an honest lagging reader still gets the oldest-first ring. A lease counts only for the
 * slot's current generation and within the channel's lease bound (now < deadline <=
 * limit), whatever its reader wrote. gens/seqs: the writer's lists (updated here). */
#define TAKEN_OFF 40
#define LEASE_MAGIC 0x31455341454C4254ull   /* b"TBLEASE1": a reader attached */
static PyObject *w_loan(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    if (n != 9) {
        PyErr_SetString(PyExc_TypeError, "loan() takes 9 arguments");
        return NULL;
    }
    Region *seg = as_region(a[0], "segment");
    if (seg == NULL)
        return NULL;
    PyObject *leases = a[1], *ctl = a[2], *gens = a[3], *seqs = a[4], *loaned = a[5];
    uint64_t now, limit;
    Py_ssize_t max_entries;
    if (!PyTuple_Check(leases) || !PyTuple_Check(ctl) || !PyList_Check(gens)
            || !PyList_Check(seqs) || !PySet_Check(loaned)) {
        PyErr_SetString(PyExc_TypeError, "loan(): bad argument types");
        return NULL;
    }
    if (get_u64(a[6], &now) < 0 || get_u64(a[7], &limit) < 0
            || get_ssize(a[8], &max_entries) < 0)
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(ctl);
    if (count > MAX_SLOTS || PyList_GET_SIZE(gens) != count || PyList_GET_SIZE(seqs) != count) {
        PyErr_SetString(PyExc_ValueError, "loan(): slot tables disagree");
        return NULL;
    }
    uint64_t gen[MAX_SLOTS];
    unsigned char blocked[MAX_SLOTS];   /* 1: leased, 2: on loan, 4: a lapsed lease */
    for (Py_ssize_t i = 0; i < count; i++) {
        if (get_u64(PyList_GET_ITEM(gens, i), &gen[i]) < 0)
            return NULL;
        blocked[i] = 0;
    }
    Py_ssize_t nleases = PyTuple_GET_SIZE(leases);
    uint64_t taken = UINT64_MAX;                  /* what every reader has taken */
    for (Py_ssize_t t = 0; t < nleases; t++) {
        Region *lr = as_region(PyTuple_GET_ITEM(leases, t), "lease table");
        if (lr == NULL)
            return NULL;
        /* Acquire: the reader stored it after its lease on that message (L2, L3), so
         * the lease entries loaded below are at least as new. Advice, like a lease:
         * a reader still in a slot it said it took is caught by its seqlock (R5). */
        uint64_t tk = 0;
        if (in_bounds(lr, TAKEN_OFF, 8)) {
            if (__atomic_load_n((uint64_t *)lr->base, RELAXED) != LEASE_MAGIC)
                tk = UINT64_MAX;                      /* never attached: not a reader */
            else
                tk = __atomic_load_n((uint64_t *)(lr->base + TAKEN_OFF), ACQUIRE);
        }
        if (tk < taken)
            taken = tk;
        for (Py_ssize_t k = 0; k < max_entries; k++) {
            Py_ssize_t off = LEASE_BASE + LEASE_STRIDE * k;
            if (!in_bounds(lr, off, LEASE_STRIDE))
                break;
            uint64_t g = __atomic_load_n((uint64_t *)(lr->base + off + 8), ACQUIRE);   /* L5 */
            if (!g)
                continue;
            uint32_t slot = __atomic_load_n((uint32_t *)(lr->base + off), RELAXED);
            uint64_t deadline = __atomic_load_n((uint64_t *)(lr->base + off + 16), RELAXED);
            if (slot < count && g == gen[slot])
                blocked[slot] |= (now < deadline && deadline <= limit) ? 1 : 4;
        }
    }
    if (PySet_GET_SIZE(loaned)) {
        PyObject *it = PyObject_GetIter(loaned), *item;
        if (it == NULL)
            return NULL;
        while ((item = PyIter_Next(it)) != NULL) {
            Py_ssize_t s = PyLong_AsSsize_t(item);
            Py_DECREF(item);
            if (s >= 0 && s < count)
                blocked[s] |= 2;
        }
        Py_DECREF(it);
        if (PyErr_Occurred())
            return NULL;
    }
    Py_ssize_t best = -1, honoured = 0, done = -1;
    uint64_t best_seq = 0, done_seq = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if ((blocked[i] & 3) == 1)
            honoured++;
        if (blocked[i] & 3)
            continue;
        uint64_t s;
        if (get_u64(PyList_GET_ITEM(seqs, i), &s) < 0)
            return NULL;
        if (best < 0 || s < best_seq) {
            best = i;
            best_seq = s;
        }
        /* A message still held on a lapsed lease is not "taken and done": it goes
         * in its oldest-first turn, as before, not first. */
        if (s && s <= taken && !(blocked[i] & 4) && (done < 0 || s > done_seq)) {
            done = i;
            done_seq = s;
        }
    }
    if (done >= 0 && taken != UINT64_MAX)         /* no reader at all: oldest first */
        best = done;
    if (best < 0)
        return Py_BuildValue("(nn)", (Py_ssize_t)-1, (Py_ssize_t)0);
    Py_ssize_t cb;
    if (get_ssize(PyTuple_GET_ITEM(ctl, best), &cb) < 0)
        return NULL;
    uint64_t *g = word_at(seg, cb, 1);
    if (g == NULL)
        return NULL;
    PyObject *ng = PyLong_FromUnsignedLongLong(gen[best] + 1);
    PyObject *slot = PyLong_FromSsize_t(best);
    if (ng == NULL || slot == NULL || PySet_Add(loaned, slot) < 0) {
        Py_XDECREF(ng);
        Py_XDECREF(slot);
        return NULL;
    }
    PyList_SetItem(gens, best, ng);                 /* steals ng */
    __atomic_store_n(g, gen[best] + 1, RELAXED);    /* W1: odd, "being written" */
    __atomic_thread_fence(RELEASE);                 /* W2: before any fill store */
    PyObject *out = Py_BuildValue("(Nn)", slot, honoured);
    return out;
}

static inline uint64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* publish(seg, cb, seq, gen, ts_or_None, ts_pos, hlen, llen, last_slot_off,
 *         last_seq_off, slot, events, leases[, sent]) -> ts
 * The header and layout are already in the slot (W3). Stores the control tail and the
 * last_slot hint, stamps the time (CLOCK_MONOTONIC, = time.monotonic_ns) into the
 * header and the control block, then W4 (gen even) and W5 (last_seq), then one wake-up
 * byte per reader socket (never blocking; a full or closed socket is that reader's).
 *
 * Wake-ups skipped (an eventcount): reader i's lease table (leases[i]) holds at
 * AWAKE_OFF the word READER_AWAKE while that reader will look at shared memory before
 * it next blocks. A reader about to block stores 0 there, then a full fence, then
 * looks for a message once more (K1-K3); the writer, after W5, makes a full fence and
 * loads the word (K4, K5): by the two fences, either the reader's last look sees this
 * message or the writer sees 0 and sends the byte. A reader that never writes the
 * word (the pure-Python path, the C++ client) reads as 0: always woken. A reader that
 * lies only loses its own wake-ups.
 *
 * One wake-up per sleep (K6; `sent`: the writer's own writable Region, one 8-byte word
 * per reader): a reader that counts its sleeps stores the new count at SLEEPS_OFF (K0,
 * relaxed) before it puts its flag down (K1, release). The writer, finding the flag
 * down (K5, acquire: the count stored before it is visible), loads the count: if it
 * already sent a byte for that very sleep (sent[i] == count), that byte is still in
 * the socket or has woken the reader, so it sends none; otherwise it sends one and
 * remembers the count. No wake-up is lost: the writer read the flag without the
 * store of any later sleep, so (K2/K4, as above) that later sleep's last look (K3)
 * sees this message; and within this sleep the byte sent before wakes it. A count of
 * 0 (a reader that does not count: pure Python, C++) is never skipped. A reader starts
 * its count at a random value, so a restarted reader never matches what the writer
 * remembers of the one before. A burst published into one sleep (a reader slow to be
 * scheduled) costs the writer one system call, not one per message. In the bench's
 * streams that was rare (bench/ipc_latency.py --syscalls, 64 B: sendto 0.72 and poll
 * 0.71 per message before, 0.79 and 0.79 after): a bound, not the bench's gain. */
#define AWAKE_OFF 16
#define READER_AWAKE 1
#define SLEEPS_OFF 32
/* The wake-up fds: a tuple of ints in range, or -1 with an exception set. */
static int check_events(PyObject *events) {
    if (!PyTuple_Check(events)) {
        PyErr_SetString(PyExc_TypeError, "publish(): events and leases must be tuples");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(events); i++) {
        long fd = PyLong_AsLong(PyTuple_GET_ITEM(events, i));
        if (fd == -1 && PyErr_Occurred())
            return -1;
        if (fd < 0 || fd > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "publish(): a wake-up fd out of range");
            return -1;
        }
    }
    return 0;
}

/* W3's tail, W4, W5 and the wake-ups (K4-K6) for a slot whose header and layout are
 * written: the body of `publish` and of `publish_hot`. 0, or -1 with an exception set
 * (nothing stored then). `*ts`: the stamp given (have_ts) or the clock's, as stored. */
static int publish_core(Region *seg, Py_ssize_t cb, uint64_t seq, uint64_t gen,
                        int have_ts, uint64_t *ts, Py_ssize_t ts_pos, uint64_t hlen,
                        uint64_t llen, Py_ssize_t last_slot_off, Py_ssize_t last_seq_off,
                        Py_ssize_t slot, PyObject *events, PyObject *leases, Region *sent) {
    if (!PyTuple_Check(events) || !PyTuple_Check(leases)) {
        PyErr_SetString(PyExc_TypeError, "publish(): events and leases must be tuples");
        return -1;
    }
    if (sent != NULL && (!sent->writable
                         || sent->len < 8 * (Py_ssize_t)PyTuple_GET_SIZE(events))) {
        PyErr_SetString(PyExc_ValueError,
                        "publish(): sent must be writable, 8 bytes per reader");
        return -1;
    }
    if (!seg->writable || !in_bounds(seg, cb, 32) || cb % 8 || !in_bounds(seg, ts_pos, 8)
            || !in_bounds(seg, last_slot_off, 4) || last_slot_off % 4
            || !in_bounds(seg, last_seq_off, 8) || last_seq_off % 8
            || hlen > 0xFFFFFFFFu || llen > 0xFFFFFFFFu || slot < 0 || slot > 0xFFFFFFFF) {
        PyErr_SetString(PyExc_ValueError, "publish(): offsets outside the segment");
        return -1;
    }
    /* Every reader's fd read before the first store: an error after W4 would leave a
     * published message the caller takes for a failed one. */
    if (check_events(events) < 0)
        return -1;
    char *b = seg->base;
    /* Control tail while gen is still odd: seq, ts (below), header_len, layout_len. */
    __atomic_store_n((uint64_t *)(b + cb + 8), seq, RELAXED);
    __atomic_store_n((uint32_t *)(b + cb + 24), (uint32_t)hlen, RELAXED);
    __atomic_store_n((uint32_t *)(b + cb + 28), (uint32_t)llen, RELAXED);
    __atomic_store_n((uint32_t *)(b + last_slot_off), (uint32_t)slot, RELAXED);
    if (!have_ts)
        *ts = monotonic_ns();
    memcpy(b + ts_pos, ts, 8);                           /* SlotHeader.publishTsNs */
    __atomic_store_n((uint64_t *)(b + cb + 16), *ts, RELAXED);
    __atomic_store_n((uint64_t *)(b + cb), gen, RELEASE);          /* W4 */
    __atomic_store_n((uint64_t *)(b + last_seq_off), seq, RELEASE); /* W5 */
    static const char one = 1;
    Py_ssize_t ne = PyTuple_GET_SIZE(events), nl = PyTuple_GET_SIZE(leases);
    if (nl)
        __atomic_thread_fence(SEQ_CST);                                /* K4 */
    for (Py_ssize_t i = 0; i < ne; i++) {
        uint64_t sleeps = 0;
        if (i < nl) {
            PyObject *lo = PyTuple_GET_ITEM(leases, i);
            if (PyObject_TypeCheck(lo, &RegionType)) {
                Region *lr = (Region *)lo;
                if (in_bounds(lr, AWAKE_OFF, 8) && __atomic_load_n(
                        (uint64_t *)(lr->base + AWAKE_OFF), ACQUIRE) == READER_AWAKE)
                    continue;                                          /* K5: it will look */
                if (sent != NULL && in_bounds(lr, SLEEPS_OFF, 8)) {
                    sleeps = __atomic_load_n((uint64_t *)(lr->base + SLEEPS_OFF), RELAXED);
                    uint64_t *mine = (uint64_t *)(sent->base + 8 * i);
                    if (sleeps != 0 && *mine == sleeps)
                        continue;                           /* K6: this sleep has its byte */
                }
            }
        }
        long fd = PyLong_AsLong(PyTuple_GET_ITEM(events, i));   /* checked above */
        if (send((int)fd, &one, 1, MSG_DONTWAIT | MSG_NOSIGNAL) < 0 && errno == ENOTSOCK) {
            ssize_t unused = write((int)fd, &one, 1);   /* an eventfd or pipe (tests) */
            (void)unused;
        }
        /* Remembered whether or not the byte went in: EAGAIN means the socket is full,
         * so the reader has bytes to wake it; EPIPE, that it is gone. */
        if (sent != NULL)
            ((uint64_t *)sent->base)[i] = sleeps;
        /* EAGAIN: full (that reader is asleep or gone: it will see it); EPIPE: closed. */
    }
    return 0;
}

static PyObject *w_publish(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    if (n != 13 && n != 14) {
        PyErr_SetString(PyExc_TypeError, "publish() takes 13 or 14 arguments");
        return NULL;
    }
    Region *seg = as_region(a[0], "segment");
    if (seg == NULL)
        return NULL;
    Py_ssize_t cb, ts_pos, last_slot_off, last_seq_off, slot;
    uint64_t seq, gen, ts = 0, hlen, llen;
    if (get_ssize(a[1], &cb) < 0 || get_u64(a[2], &seq) < 0 || get_u64(a[3], &gen) < 0
            || (a[4] != Py_None && get_u64(a[4], &ts) < 0) || get_ssize(a[5], &ts_pos) < 0
            || get_u64(a[6], &hlen) < 0 || get_u64(a[7], &llen) < 0
            || get_ssize(a[8], &last_slot_off) < 0 || get_ssize(a[9], &last_seq_off) < 0
            || get_ssize(a[10], &slot) < 0)
        return NULL;
    Region *sent = NULL;              /* K6: the count each reader was last woken for */
    if (n == 14 && a[13] != Py_None) {
        sent = as_region(a[13], "sent");
        if (sent == NULL)
            return NULL;
    }
    if (publish_core(seg, cb, seq, gen, a[4] != Py_None, &ts, ts_pos, hlen, llen,
                     last_slot_off, last_seq_off, slot, a[11], a[12], sent) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(ts);
}

/* ------------------------------------------------------------- the reader */

static PyObject *accept_core(PyObject *rawo, PyObject *compiled, PyObject *ctx,
                             uint64_t want_seq, uint64_t want_gen, uint64_t now,
                             uint64_t last_capture, PyObject **receipt);

/* The reader's context tuple (codec.native_ctx): 14 integers, then these. */
enum { CTX_STAMP = 14, CTX_SLOW, CTX_RTABLE, CTX_LEN };
enum { CTX_NEED_CRC = 9 };

static int need_crc_of(PyObject *ctx) {
    return PyLong_Check(PyTuple_GET_ITEM(ctx, CTX_NEED_CRC))
        && PyObject_IsTrue(PyTuple_GET_ITEM(ctx, CTX_NEED_CRC)) == 1;
}

/* take(seg, lease, ctl, hdr, lay, want, k, deadline, hdr_max, lay_max, last_seq_off,
 *      last_slot_off, retries, compiled, ctx, last_capture, last, pay)
 *   -> None (nothing newer than want - 1 is stable), False (a message is there but k < 0:
 *      no lease free), or (slot, gen, seq, raw_header, raw_layout, stamp, receipt,
 *      crc_ok) with lease k held.
 *   last: None, or (raw_layout, lo, hi): the layout the reader validated last and the
 *      payload span [lo, hi) it touches. Only for a message in that layout: stamp is
 *      `accept`'s verdict (clock read after the copy), receipt the Receipt `receipt`
 *      reads from the header copy (None: it has none; ctx's slow sentinel: Python
 *      decodes it on demand), and crc_ok is 1 when the header's CRC-32 matched the
 *      payload span (pay[slot] + [lo, hi)) and the slot was still stable after it
 *      (R4 + R5 again). Anything else: stamp None, receipt the sentinel, crc_ok 0, and
 *      the Python path checks what it must.
 * R1, R2, L1-L3, R3 (copies), R4, R5 as in the argument at the top; a slot the writer
 * took meanwhile is looked for again, at most `retries` times. */
static PyObject *r_take(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    if (n != 18) {
        PyErr_SetString(PyExc_TypeError, "take() takes 18 arguments");
        return NULL;
    }
    uint64_t last_capture;
    if (get_u64(a[15], &last_capture) < 0)
        return NULL;
    Region *seg = as_region(a[0], "segment");
    Region *lease = seg ? as_region(a[1], "lease table") : NULL;
    if (lease == NULL)
        return NULL;
    PyObject *ctl = a[2], *hdr = a[3], *lay = a[4], *pay = a[17];
    uint64_t want, deadline;
    Py_ssize_t k, hdr_max, lay_max, last_seq_off, last_slot_off, retries;
    if (!PyTuple_Check(ctl) || !PyTuple_Check(hdr) || !PyTuple_Check(lay)
            || !PyTuple_Check(pay)) {
        PyErr_SetString(PyExc_TypeError, "take(): offsets must be tuples");
        return NULL;
    }
    if (get_u64(a[5], &want) < 0 || get_ssize(a[6], &k) < 0 || get_u64(a[7], &deadline) < 0
            || get_ssize(a[8], &hdr_max) < 0 || get_ssize(a[9], &lay_max) < 0
            || get_ssize(a[10], &last_seq_off) < 0 || get_ssize(a[11], &last_slot_off) < 0
            || get_ssize(a[12], &retries) < 0)
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(ctl);
    if (PyTuple_GET_SIZE(hdr) != count || PyTuple_GET_SIZE(lay) != count
            || PyTuple_GET_SIZE(pay) != count) {
        PyErr_SetString(PyExc_ValueError, "take(): slot tables disagree");
        return NULL;
    }
    /* The layout validated last and its payload span, if any. */
    PyObject *last = NULL;
    Py_ssize_t span_lo = 0, span_hi = 0;
    if (a[16] != Py_None) {
        if (!PyTuple_Check(a[16]) || PyTuple_GET_SIZE(a[16]) != 3
                || !PyBytes_Check(PyTuple_GET_ITEM(a[16], 0))) {
            PyErr_SetString(PyExc_TypeError, "take(): last must be (bytes, lo, hi) or None");
            return NULL;
        }
        last = PyTuple_GET_ITEM(a[16], 0);
        if (get_ssize(PyTuple_GET_ITEM(a[16], 1), &span_lo) < 0
                || get_ssize(PyTuple_GET_ITEM(a[16], 2), &span_hi) < 0)
            return NULL;
        if (span_lo < 0 || span_hi < span_lo) {
            PyErr_SetString(PyExc_ValueError, "take(): bad payload span");
            return NULL;
        }
    }
    PyObject *slow = PyTuple_Check(a[14]) && PyTuple_GET_SIZE(a[14]) == CTX_LEN
        ? PyTuple_GET_ITEM(a[14], CTX_SLOW) : NULL;
    if (slow == NULL) {
        PyErr_SetString(PyExc_TypeError, "take(): bad ctx");
        return NULL;
    }
    Py_ssize_t lease_off = k >= 0 ? lease_offset(lease, k) : -1;
    if (!in_bounds(seg, last_seq_off, 8) || last_seq_off % 8
            || !in_bounds(seg, last_slot_off, 4) || last_slot_off % 4
            || (k >= 0 && (!lease->writable || lease_off < 0
                           || !in_bounds(lease, lease_off, LEASE_STRIDE)))) {
        PyErr_SetString(PyExc_ValueError, "take(): offsets outside the mappings");
        return NULL;
    }
    char *b = seg->base;
    for (Py_ssize_t attempt = 0; attempt < retries; attempt++) {
        uint64_t latest = __atomic_load_n((uint64_t *)(b + last_seq_off), ACQUIRE);  /* R1 */
        if (latest < want)
            return Py_NewRef(Py_None);
        uint32_t hint = __atomic_load_n((uint32_t *)(b + last_slot_off), RELAXED);
        Py_ssize_t slot = -1, cb = 0;
        uint64_t g1 = 0, seq = 0;
        if (hint < (uint64_t)count) {
            if (get_ssize(PyTuple_GET_ITEM(ctl, hint), &cb) < 0)
                return NULL;
            if (!in_bounds(seg, cb, 32) || cb % 8)
                goto bad_offsets;
            g1 = __atomic_load_n((uint64_t *)(b + cb), ACQUIRE);            /* R2 */
            seq = __atomic_load_n((uint64_t *)(b + cb + 8), RELAXED);
            if (seq == want && !(g1 & 1))
                slot = hint;
        }
        if (slot < 0) {
            uint64_t best_seq = 0;
            for (Py_ssize_t i = 0; i < count; i++) {
                Py_ssize_t c;
                if (get_ssize(PyTuple_GET_ITEM(ctl, i), &c) < 0)
                    return NULL;
                if (!in_bounds(seg, c, 32) || c % 8)
                    goto bad_offsets;
                uint64_t g = __atomic_load_n((uint64_t *)(b + c), ACQUIRE);  /* R2 */
                uint64_t s = __atomic_load_n((uint64_t *)(b + c + 8), RELAXED);
                if (!(g & 1) && s >= want && (slot < 0 || s < best_seq)) {
                    slot = i;
                    best_seq = s;
                    g1 = g;
                    cb = c;
                }
            }
            if (slot < 0)
                return Py_NewRef(Py_None);
            seq = best_seq;
        }
        if (k < 0)
            return Py_NewRef(Py_False);
        uint32_t hlen = __atomic_load_n((uint32_t *)(b + cb + 24), RELAXED);
        uint32_t llen = __atomic_load_n((uint32_t *)(b + cb + 28), RELAXED);
        Py_ssize_t ho, lo;
        if (get_ssize(PyTuple_GET_ITEM(hdr, slot), &ho) < 0
                || get_ssize(PyTuple_GET_ITEM(lay, slot), &lo) < 0)
            return NULL;
        Py_ssize_t hn = hlen < (uint64_t)hdr_max ? (Py_ssize_t)hlen : hdr_max;
        Py_ssize_t ln = llen < (uint64_t)lay_max ? (Py_ssize_t)llen : lay_max;
        if (!in_bounds(seg, ho, hn) || !in_bounds(seg, lo, ln))
            goto bad_offsets;
        char *e = lease->base + lease_off;
        __atomic_store_n((uint32_t *)e, (uint32_t)slot, RELAXED);            /* L1 */
        __atomic_store_n((uint64_t *)(e + 16), deadline, RELAXED);
        __atomic_store_n((uint64_t *)(e + 8), g1, RELEASE);                   /* L2 */
        __atomic_thread_fence(SEQ_CST);                                       /* L3 */
        PyObject *raw_h = PyBytes_FromStringAndSize(b + ho, hn);              /* R3 */
        PyObject *raw_l = raw_h ? PyBytes_FromStringAndSize(b + lo, ln) : NULL;
        __atomic_thread_fence(ACQUIRE);                                       /* R4 */
        uint64_t g2 = __atomic_load_n((uint64_t *)(b + cb), RELAXED);         /* R5 */
        if (raw_l == NULL || g2 != g1) {
            __atomic_store_n((uint64_t *)(e + 8), 0, RELEASE);                /* L4 */
            Py_XDECREF(raw_h);
            Py_XDECREF(raw_l);
            if (PyErr_Occurred())
                return NULL;
            continue;   /* the writer took the slot while we leased it: look again */
        }
        PyObject *stamp = NULL, *receipt = NULL;
        int crc_ok = 0;
        if (last != NULL && PyBytes_GET_SIZE(last) == ln
                && memcmp(PyBytes_AS_STRING(last), PyBytes_AS_STRING(raw_l), ln) == 0)
            stamp = accept_core(raw_h, a[13], a[14], seq, g1, monotonic_ns(), last_capture,
                                &receipt);
        else
            stamp = Py_NewRef(Py_None);
        if (stamp != NULL && stamp != Py_None && PyTuple_GET_ITEM(stamp, 4) != Py_None
                && need_crc_of(a[14])) {
            /* The payload against the header's CRC-32, then the seqlock again (R4 + R5:
             * the payload bytes are plain loads like R3's). */
            Py_ssize_t po;
            if (get_ssize(PyTuple_GET_ITEM(pay, slot), &po) < 0) {
                Py_CLEAR(stamp);
            } else if (in_bounds(seg, po + span_lo, span_hi - span_lo)) {
                const Bytef *p = (const Bytef *)(b + po + span_lo);
                Py_ssize_t len = span_hi - span_lo;
                /* With the GIL held: the mappings must stay while p points into them
                 * (red team: a close() from another thread meanwhile crashed). */
                uLong crc = crc32_z(crc32(0L, Z_NULL, 0), p, (z_size_t)len);
                __atomic_thread_fence(ACQUIRE);                               /* R4 */
                uint64_t g3 = __atomic_load_n((uint64_t *)(b + cb), RELAXED);  /* R5 */
                unsigned long want_crc = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(stamp, 4));
                if (want_crc == (unsigned long)-1 && PyErr_Occurred())
                    Py_CLEAR(stamp);
                else
                    crc_ok = g3 == g1 && crc == want_crc;
            }
        }
        if (stamp == NULL) {
            __atomic_store_n((uint64_t *)(e + 8), 0, RELEASE);
            Py_DECREF(raw_h);
            Py_DECREF(raw_l);
            Py_XDECREF(receipt);
            return NULL;
        }
        if (receipt == NULL)
            receipt = Py_NewRef(slow);
        return Py_BuildValue("(nKKNNNNi)", slot, (unsigned long long)g1,
                             (unsigned long long)seq, raw_h, raw_l, stamp, receipt, crc_ok);
    }
    return Py_NewRef(Py_None);
bad_offsets:
    PyErr_SetString(PyExc_ValueError, "take(): slot offsets outside the segment");
    return NULL;
}

/* ------------------------------------------------------------- header check */

/* Read the scalar with struct code `c` at raw[pos] (little-endian, as capnp is). */
static PyObject *read_scalar(const unsigned char *raw, Py_ssize_t pos, int c) {
    union { uint8_t b[8]; uint64_t q; uint32_t i; uint16_t h; float f; double d; } u;
    memset(&u, 0, sizeof u);
    switch (c) {
    case 'Q': memcpy(u.b, raw + pos, 8); return PyLong_FromUnsignedLongLong(u.q);
    case 'q': memcpy(u.b, raw + pos, 8); return PyLong_FromLongLong((int64_t)u.q);
    case 'I': memcpy(u.b, raw + pos, 4); return PyLong_FromUnsignedLong(u.i);
    case 'i': memcpy(u.b, raw + pos, 4); return PyLong_FromLong((int32_t)u.i);
    case 'H': memcpy(u.b, raw + pos, 2); return PyLong_FromUnsignedLong(u.h);
    case 'h': memcpy(u.b, raw + pos, 2); return PyLong_FromLong((int16_t)u.h);
    case 'B': return PyLong_FromUnsignedLong(raw[pos]);
    case 'b': return PyLong_FromLong((int8_t)raw[pos]);
    case 'f': memcpy(u.b, raw + pos, 4); return PyFloat_FromDouble((double)u.f);
    case 'd': memcpy(u.b, raw + pos, 8); return PyFloat_FromDouble(u.d);
    }
    return NULL;
}

static int scalar_size(int c) {
    switch (c) {
    case 'Q': case 'q': case 'd': return 8;
    case 'I': case 'i': case 'f': return 4;
    case 'H': case 'h': return 2;
    case 'B': case 'b': return 1;
    }
    return 0;
}

/* Unsigned value of an integer field (the discriminants and the u64 timestamps). */
static uint64_t read_u(const unsigned char *raw, Py_ssize_t pos, int c) {
    uint64_t v = 0;
    int n = scalar_size(c);
    memcpy(&v, raw + pos, n);   /* little-endian host: asserted at import */
    return v;
}


/* An instance of the tuple subclass `type` (Stamp, Receipt) holding items[0..n), whose
 * references it steals, even on failure; NULL with an exception set if an item is NULL
 * (its error stands) or `type` is not a tuple subclass (TypeError naming `what`). */
static PyObject *tuple_of(PyObject *type, PyObject **items, Py_ssize_t n, const char *what) {
    PyTypeObject *t = (PyTypeObject *)type;
    PyObject *out = NULL;
    int ok = 1;
    for (Py_ssize_t i = 0; i < n; i++)
        ok &= items[i] != NULL;
    if (ok && PyType_Check(type) && PyType_IsSubtype(t, &PyTuple_Type))
        out = t->tp_alloc(t, n);
    if (out == NULL) {
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(items[i]);
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "%s: not a tuple type", what);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(out, i, items[i]);
    return out;
}

/* ------------------------------------------------------------- receipt */

/* (start, count) of the byte list whose pointer word sits at raw[pos]: 1 with
 * *start = *count = 0 for a null pointer; 0 for anything else (the caller lets
 * pycapnp decide). As _fast_receipt._byte_list. */
static int byte_list(const unsigned char *raw, Py_ssize_t pos, Py_ssize_t end,
                     Py_ssize_t *start, Py_ssize_t *count) {
    uint64_t w;
    memcpy(&w, raw + pos, 8);
    *start = *count = 0;
    if (w == 0)
        return 1;
    if ((w & 3) != 1 || ((w >> 32) & 7) != 2)
        return 0;                 /* not a list pointer, or not a list of bytes */
    int64_t off = (int64_t)((w & 0xFFFFFFFFu) >> 2);
    if (off >= (1 << 29))
        off -= (1 << 30);
    int64_t n = (int64_t)(w >> 35);
    int64_t st = (int64_t)pos + 8 + off * 8;
    if (st < 8 || st + (n + 7) / 8 * 8 > (int64_t)end)
        return 0;
    *start = (Py_ssize_t)st;
    *count = (Py_ssize_t)n;
    return 1;
}

enum { RT_TYPE, RT_COMPLETION, RT_DEVICE, RT_SHA, RT_SCALARS, RT_NSCALARS = 12 };

/* receipt_core(raw, rpos, end, rtable, slow) -> Receipt | None | slow (new reference)
 *
 * The Receipt a SlotHeader's receipt pointer (at raw[rpos], segment end `end`) leads
 * to, read as `_fast_receipt._ReceiptReading.receipt` reads it: None for a null
 * pointer; `slow` for anything that reading would hand to pycapnp (far or non-struct
 * pointer, out of bounds, an older Receipt without every field, a bad Text or Data,
 * an unknown completion point). The tests compare all three readings.
 *
 * rtable: (Receipt type, completion names by value, device pointer index, sha pointer
 *          index, then (offset, struct code) per scalar in _fast_fields._R_SCALARS
 *          order: 11 integers, then completion) */
static PyObject *receipt_core(const unsigned char *raw, Py_ssize_t rpos, Py_ssize_t end,
                              PyObject *rtable, PyObject *slow) {
    if (!PyTuple_Check(rtable) || PyTuple_GET_SIZE(rtable) != RT_SCALARS + 2 * RT_NSCALARS
            || !PyTuple_Check(PyTuple_GET_ITEM(rtable, RT_COMPLETION))) {
        PyErr_SetString(PyExc_TypeError, "receipt(): bad receipt table");
        return NULL;
    }
    if (rpos < 8 || rpos + 8 > end)
        return Py_NewRef(slow);
    uint64_t rw;
    memcpy(&rw, raw + rpos, 8);
    if (rw == 0)
        return Py_NewRef(Py_None);
    if (rw & 3)
        return Py_NewRef(slow);               /* not a struct pointer (far, list, ...) */
    int64_t off = (int64_t)((rw & 0xFFFFFFFFu) >> 2);
    if (off >= (1 << 29))
        off -= (1 << 30);
    int64_t dwords = (int64_t)((rw >> 32) & 0xFFFF), pcount = (int64_t)(rw >> 48);
    int64_t start = (int64_t)rpos + 8 + off * 8;
    if (start < 8 || start + (dwords + pcount) * 8 > (int64_t)end)
        return Py_NewRef(slow);
    Py_ssize_t dptr, sptr;
    if (get_ssize(PyTuple_GET_ITEM(rtable, RT_DEVICE), &dptr) < 0
            || get_ssize(PyTuple_GET_ITEM(rtable, RT_SHA), &sptr) < 0)
        return NULL;
    if (dptr < 0 || sptr < 0 || dptr >= pcount || sptr >= pcount)
        return Py_NewRef(slow);
    uint64_t v[RT_NSCALARS];
    int code[RT_NSCALARS];
    Py_ssize_t pos[RT_NSCALARS];
    for (int i = 0; i < RT_NSCALARS; i++) {
        Py_ssize_t o, c;
        if (get_ssize(PyTuple_GET_ITEM(rtable, RT_SCALARS + 2 * i), &o) < 0
                || get_ssize(PyTuple_GET_ITEM(rtable, RT_SCALARS + 2 * i + 1), &c) < 0)
            return NULL;
        int sz = scalar_size((int)c);
        if (sz == 0 || c == 'f' || c == 'd') {
            PyErr_SetString(PyExc_TypeError, "receipt(): receipt scalars must be integers");
            return NULL;
        }
        if (o < 0 || o + sz > dwords * 8)
            return Py_NewRef(slow);           /* an older, shorter Receipt */
        pos[i] = (Py_ssize_t)start + o;
        code[i] = (int)c;
        v[i] = read_u(raw, pos[i], code[i]);
    }
    Py_ssize_t ptrs = (Py_ssize_t)(start + dwords * 8), ds, dn, ss, sn;
    if (!byte_list(raw, ptrs + dptr * 8, end, &ds, &dn)
            || !byte_list(raw, ptrs + sptr * 8, end, &ss, &sn))
        return Py_NewRef(slow);
    PyObject *names = PyTuple_GET_ITEM(rtable, RT_COMPLETION);
    uint64_t comp = v[RT_NSCALARS - 1];
    if (comp >= (uint64_t)PyTuple_GET_SIZE(names) || PyTuple_GET_ITEM(names, comp) == Py_None)
        return Py_NewRef(slow);               /* not a completion point we know */
    PyObject *device;
    if (ds == 0 && dn == 0) {
        device = PyUnicode_FromStringAndSize("", 0);
    } else {
        /* Text: NUL-terminated, no NUL inside, UTF-8; the first 64 characters kept. */
        if (dn < 1 || raw[ds + dn - 1] != 0 || memchr(raw + ds, 0, dn - 1) != NULL)
            return Py_NewRef(slow);
        device = PyUnicode_DecodeUTF8((const char *)raw + ds, dn - 1, "strict");
        if (device == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
                return NULL;
            PyErr_Clear();
            return Py_NewRef(slow);
        }
        if (PyUnicode_GET_LENGTH(device) > 64) {
            PyObject *cut = PyUnicode_Substring(device, 0, 64);
            Py_SETREF(device, cut);
        }
    }
    if (device == NULL)
        return NULL;
    PyObject *items[14];
    /* Receipt(frame_id, capture_ts_ns, infer_start_ns, infer_end_ns, device, bytes_in,
     *         bytes_out, completion, latency_ns, worst_case_ns, deadline_ns,
     *         deadline_misses, artifact_sha256, kernels_run) */
    static const int from[14] = {0, 1, 2, 3, -1, 4, 5, -2, 6, 7, 8, 9, -3, 10};
    for (int i = 0; i < 14; i++) {
        int f = from[i];
        if (f >= 0)
            items[i] = read_scalar(raw, pos[f], code[f]);
        else if (f == -1)
            items[i] = device;
        else if (f == -2)
            items[i] = Py_NewRef(PyTuple_GET_ITEM(names, comp));
        else
            items[i] = PyBytes_FromStringAndSize((const char *)raw + ss, sn < 64 ? sn : 64);
    }
    return tuple_of(PyTuple_GET_ITEM(rtable, RT_TYPE), items, 14, "receipt(): Receipt type");
}

/* receipt(raw, rpos, end, rtable, slow): receipt_core for Python (the tests). */
static PyObject *h_receipt(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    Py_ssize_t rpos, end;
    if (n != 5) {
        PyErr_SetString(PyExc_TypeError, "receipt() takes 5 arguments");
        return NULL;
    }
    if (!PyBytes_Check(a[0])) {
        PyErr_SetString(PyExc_TypeError, "receipt(): raw must be bytes");
        return NULL;
    }
    if (get_ssize(a[1], &rpos) < 0 || get_ssize(a[2], &end) < 0)
        return NULL;
    if (end < 0 || end > PyBytes_GET_SIZE(a[0])) {
        PyErr_SetString(PyExc_ValueError, "receipt(): end outside raw");
        return NULL;
    }
    return receipt_core((const unsigned char *)PyBytes_AS_STRING(a[0]), rpos, end, a[3], a[4]);
}

enum { F_VERSION, F_CHANNEL, F_SEQ, F_GEN, F_PID, F_CRC_WHICH, F_FRAME_WHICH, F_TS, F_CRC,
       F_WORD, F_FRAME_ID, F_CAPTURE, F_EXP_WHICH, F_GAIN_WHICH, F_EXP, F_GAIN, F_MAX };

/* A compiled structure's native table, read once (ReaderCore keeps the one it used
 * last, by the identity of the compiled entry). */
typedef struct {
    Py_ssize_t end, rpos, nfields;
    uint64_t has_meta, meta_word;
    Py_ssize_t pos[F_MAX];
    int code[F_MAX];
} Plan;

/* The plan of compiled entry `st`: 1, 0 (no native table for this structure: the
 * Python path decides), or -1 with an exception set. */
static int plan_of(PyObject *st, Plan *p) {
    if (!PyTuple_Check(st) || PyTuple_GET_SIZE(st) < 1)
        return 0;
    PyObject *nt = PyTuple_GET_ITEM(st, PyTuple_GET_SIZE(st) - 1);
    if (!PyTuple_Check(nt) || PyTuple_GET_SIZE(nt) < 4)
        return 0;                             /* no native table for this structure */
    p->nfields = (PyTuple_GET_SIZE(nt) - 4) / 2;
    if (p->nfields != F_WORD && p->nfields != F_MAX)
        return 0;
    if (get_ssize(PyTuple_GET_ITEM(nt, 0), &p->end) < 0
            || get_ssize(PyTuple_GET_ITEM(nt, 1), &p->rpos) < 0
            || get_u64(PyTuple_GET_ITEM(nt, 2), &p->has_meta) < 0
            || get_u64(PyTuple_GET_ITEM(nt, 3), &p->meta_word) < 0)
        return -1;
    if ((p->has_meta != 0) != (p->nfields == F_MAX))
        return 0;
    for (Py_ssize_t i = 0; i < p->nfields; i++) {
        Py_ssize_t cc;
        if (get_ssize(PyTuple_GET_ITEM(nt, 4 + 2 * i), &p->pos[i]) < 0
                || get_ssize(PyTuple_GET_ITEM(nt, 5 + 2 * i), &cc) < 0)
            return -1;
        p->code[i] = (int)cc;
        int sz = scalar_size(p->code[i]);
        if (sz == 0 || p->pos[i] < 0 || p->pos[i] + sz > p->end)
            return 0;
    }
    /* Integer fields the checks need as integers (everything but gain). */
    for (int i = 0; i < p->nfields; i++)
        if (i != F_GAIN && (p->code[i] == 'f' || p->code[i] == 'd'))
            return 0;
    return 1;
}

/* The 14 integers at the head of ctx: 0, or -1 with an exception set. */
static int ctx_values(PyObject *ctx, uint64_t c[14]) {
    for (int i = 0; i < 14; i++)
        if (get_u64(PyTuple_GET_ITEM(ctx, i), &c[i]) < 0)
            return -1;
    return 0;
}

/* accept(raw, compiled, ctx, seq, gen, now, last_capture) -> Stamp | None
 *
 * The reader's every check on a SlotHeader, for headers whose structure the compiled
 * Python path has already seen (`_fast_header._Structure.native`) and that pass all of
 * them: the structural checks of `_HeaderReading.decode`, the control block's sequence
 * and generation, future timestamps (the receipt's too), capture order, age. Anything else,
 * accepted or not, is None: the reader then runs its Python checks on the same bytes,
 * which decide (and raise the typed rejection). So this path only ever shortens an
 * acceptance the Python path would make with the same Stamp (the tests compare).
 *
 * ctx: (crc_n, crc_is, frame_n, frame_is, exp_n, exp_is, gain_n, gain_is, channel_id,
 *       need_crc, need_frame, tolerance_ns, max_age_ns, receipt captureTsNs offset in
 *       the Receipt's data section, Stamp type) */
static PyObject *accept_plan(const Plan *p, const uint64_t c[14], PyObject *ctx,
                             const unsigned char *raw, Py_ssize_t len, uint64_t want_seq,
                             uint64_t want_gen, uint64_t now, uint64_t last_capture,
                             PyObject **receipt);

static PyObject *accept_core(PyObject *rawo, PyObject *compiled, PyObject *ctx,
                             uint64_t want_seq, uint64_t want_gen, uint64_t now,
                             uint64_t last_capture, PyObject **receipt) {
    if (!PyBytes_Check(rawo) || !PyDict_Check(compiled) || !PyTuple_Check(ctx)
            || PyTuple_GET_SIZE(ctx) != CTX_LEN) {
        PyErr_SetString(PyExc_TypeError, "accept(): bad argument types");
        return NULL;
    }
    const unsigned char *raw = (const unsigned char *)PyBytes_AS_STRING(rawo);
    Py_ssize_t len = PyBytes_GET_SIZE(rawo);
    if (len < 16)
        Py_RETURN_NONE;
    uint64_t c[14];
    if (ctx_values(ctx, c) < 0)
        return NULL;
    PyObject *key = PyBytes_FromStringAndSize((const char *)raw, 16);
    if (key == NULL)
        return NULL;
    PyObject *st = PyDict_GetItemWithError(compiled, key);   /* borrowed */
    Py_DECREF(key);
    if (st == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    Plan plan;
    int got = plan_of(st, &plan);
    if (got <= 0)
        return got < 0 ? NULL : Py_NewRef(Py_None);
    return accept_plan(&plan, c, ctx, raw, len, want_seq, want_gen, now, last_capture,
                       receipt);
}

/* accept_core's checks once the structure's plan is known. */
static PyObject *accept_plan(const Plan *p, const uint64_t c[14], PyObject *ctx,
                             const unsigned char *raw, Py_ssize_t len, uint64_t want_seq,
                             uint64_t want_gen, uint64_t now, uint64_t last_capture,
                             PyObject **receipt) {
    Py_ssize_t end = p->end, rpos = p->rpos, nfields = p->nfields;
    uint64_t has_meta = p->has_meta, meta_word = p->meta_word;
    const Py_ssize_t *pos = p->pos;
    const int *code = p->code;
    if (len < end || len % 8)
        Py_RETURN_NONE;                       /* pycapnp refuses partial words too */
    uint64_t v[F_MAX];
    for (int i = 0; i < nfields; i++)
        v[i] = i == F_GAIN ? 0 : read_u(raw, pos[i], code[i]);
    uint64_t crc_n = c[0], crc_is = c[1], frame_n = c[2], frame_is = c[3], exp_n = c[4],
             exp_is = c[5], gain_n = c[6], gain_is = c[7], channel_id = c[8],
             need_crc = c[9], need_frame = c[10], tol = c[11], max_age = c[12],
             r_capture_off = c[13];
    int has_frame = 0, has_exp = 0, has_gain = 0;
    if (v[F_CRC_WHICH] >= crc_n || v[F_FRAME_WHICH] >= frame_n)
        Py_RETURN_NONE;                       /* unknown union member */
    if (has_meta) {
        if (v[F_FRAME_WHICH] == frame_is) {
            if (v[F_WORD] != meta_word)
                Py_RETURN_NONE;               /* FrameMeta is elsewhere */
            if (v[F_EXP_WHICH] >= exp_n || v[F_GAIN_WHICH] >= gain_n)
                Py_RETURN_NONE;
            has_frame = 1;
            has_exp = v[F_EXP_WHICH] == exp_is;
            has_gain = v[F_GAIN_WHICH] == gain_is;
        }
    } else if (v[F_FRAME_WHICH] == frame_is) {
        Py_RETURN_NONE;                       /* FrameMeta is not plain here */
    }
    int has_crc = v[F_CRC_WHICH] == crc_is;
    if (!(v[F_VERSION] >= 1 && v[F_CHANNEL] == channel_id && (has_crc || !need_crc)
            && (has_frame || !need_frame)))
        Py_RETURN_NONE;                       /* the Python path raises the rejection */
    /* The reader's checks (Reader._accept), in its order. */
    if (v[F_SEQ] != want_seq || v[F_GEN] != want_gen)
        Py_RETURN_NONE;
    uint64_t latest = now + tol, publish_ts = v[F_TS], ts = publish_ts;
    if (latest < now || publish_ts > latest)
        Py_RETURN_NONE;
    if (has_frame) {
        uint64_t capture = v[F_CAPTURE];
        ts = capture;
        if (capture > latest || capture > publish_ts || capture < last_capture)
            Py_RETURN_NONE;
    }
    if (rpos >= 0) {
        /* A receipt (model outputs): its captureTsNs must not lie in the future. Only a
         * plain struct pointer whose data section holds the field is read here; the
         * bytes are the ones pycapnp and the compiled reader read. Anything else: the
         * Python path decides. The Receipt itself is decoded on demand, as there. */
        uint64_t rw;
        if (rpos + 8 > end)
            Py_RETURN_NONE;
        memcpy(&rw, raw + rpos, 8);
        if (rw != 0) {
            if (rw & 3)
                Py_RETURN_NONE;               /* not a struct pointer (far, list, ...) */
            int64_t off = (int64_t)((rw & 0xFFFFFFFFu) >> 2);
            if (off >= (1 << 29))
                off -= (1 << 30);
            uint64_t dwords = (rw >> 32) & 0xFFFF, pcount = rw >> 48;
            int64_t start = (int64_t)rpos + 8 + off * 8;
            if (start < 8 || start + (int64_t)((dwords + pcount) * 8) > (int64_t)end
                    || r_capture_off + 8 > dwords * 8)
                Py_RETURN_NONE;
            uint64_t r_capture;
            memcpy(&r_capture, raw + start + r_capture_off, 8);
            if (r_capture > latest)
                Py_RETURN_NONE;               /* FutureTimestamp: Python raises it */
        }
    }
    if (max_age && now > ts && now - ts > max_age)
        Py_RETURN_NONE;
    /* Stamp(sequence, generation, writer_pid, publish_ts_ns, crc32, frame_id,
     *       capture_ts_ns, exposure_us, gain) */
    PyObject *items[9];
    items[0] = read_scalar(raw, pos[F_SEQ], code[F_SEQ]);
    items[1] = read_scalar(raw, pos[F_GEN], code[F_GEN]);
    items[2] = read_scalar(raw, pos[F_PID], code[F_PID]);
    items[3] = read_scalar(raw, pos[F_TS], code[F_TS]);
    items[4] = has_crc ? read_scalar(raw, pos[F_CRC], code[F_CRC]) : Py_NewRef(Py_None);
    items[5] = has_frame ? read_scalar(raw, pos[F_FRAME_ID], code[F_FRAME_ID]) : Py_NewRef(Py_None);
    items[6] = has_frame ? read_scalar(raw, pos[F_CAPTURE], code[F_CAPTURE]) : Py_NewRef(Py_None);
    items[7] = has_exp ? read_scalar(raw, pos[F_EXP], code[F_EXP]) : Py_NewRef(Py_None);
    items[8] = has_gain ? read_scalar(raw, pos[F_GAIN], code[F_GAIN]) : Py_NewRef(Py_None);
    PyObject *out = tuple_of(PyTuple_GET_ITEM(ctx, CTX_STAMP), items, 9, "accept(): Stamp type");
    if (out == NULL)
        return NULL;
    if (receipt != NULL && PyTuple_GET_ITEM(ctx, CTX_RTABLE) != Py_None) {
        *receipt = rpos < 0 ? Py_NewRef(Py_None)
            : receipt_core(raw, rpos, end, PyTuple_GET_ITEM(ctx, CTX_RTABLE),
                           PyTuple_GET_ITEM(ctx, CTX_SLOW));
        if (*receipt == NULL)
            Py_CLEAR(out);
    }
    return out;
}

/* ------------------------------------------------------------- header write */

static int put_scalar(unsigned char *dst, int c, PyObject *o) {
    /* 0: written; 1: value outside the field (the caller lets Python raise); -1: error */
    if (c == 'f' || c == 'd') {
        double d = PyFloat_AsDouble(o);
        if (d == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        if (c == 'd') {
            memcpy(dst, &d, 8);
            return 0;
        }
        float f = (float)d;
        if (isinf(f) && !isinf(d))
            return 1;                         /* struct raises OverflowError */
        memcpy(dst, &f, 4);
        return 0;
    }
    if (!PyLong_Check(o))
        return 1;
    int size = scalar_size(c);
    if (c == 'Q' || c == 'I' || c == 'H' || c == 'B') {
        unsigned long long v = PyLong_AsUnsignedLongLong(o);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        if (size < 8 && v >> (8 * size))
            return 1;
        memcpy(dst, &v, size);
        return 0;
    }
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    if (size < 8) {
        long long lim = 1ll << (8 * size - 1);
        if (v < -lim || v >= lim)
            return 1;
    }
    memcpy(dst, &v, size);
    return 0;
}

#define MAX_EXTRA 24
/* The body of `pack_header` and of `publish_hot`: v = (seq, gen, ts, crc, frame_id,
 * capture, exposure, gain). 0: written; 1: a value outside its field (nothing promised
 * about the bytes written: the slot is still odd); -1: an exception set. */
static int pack_core(Region *seg, Py_ssize_t base, PyObject *tmpl, PyObject *table,
                     PyObject *const *v, PyObject *extra) {
    if (extra != Py_None && (!PyTuple_Check(extra) || PyTuple_GET_SIZE(extra) > MAX_EXTRA)) {
        PyErr_SetString(PyExc_TypeError, "pack_header(): extra must be a short tuple");
        return -1;
    }
    if (!PyBytes_Check(tmpl) || !PyTuple_Check(table) || PyTuple_GET_SIZE(table) < 6) {
        PyErr_SetString(PyExc_TypeError, "pack_header(): bad argument types");
        return -1;
    }
    Py_ssize_t tlen = PyBytes_GET_SIZE(tmpl);
    if (!seg->writable || !in_bounds(seg, base, tlen)) {
        PyErr_SetString(PyExc_ValueError, "pack_header(): header outside the segment");
        return -1;
    }
    uint64_t t[6];
    for (int i = 0; i < 6; i++)
        if (get_u64(PyTuple_GET_ITEM(table, i), &t[i]) < 0)
            return -1;
    int has_crc = (int)t[0], has_frame = (int)t[1];
    Py_ssize_t n_extra = extra == Py_None ? 0 : PyTuple_GET_SIZE(extra);
    if (PyTuple_GET_SIZE(table) != 6 + 2 * (3 + (has_crc != 0) + 6 * (has_frame != 0) + n_extra)) {
        PyErr_SetString(PyExc_ValueError, "pack_header(): table does not match the plan");
        return -1;
    }
    PyObject *vals[10 + MAX_EXTRA];     /* 3 + crc + 6 frame fields, then the extra */
    int nv = 0, res = -1;
    vals[nv++] = v[0];                 /* sequence */
    vals[nv++] = v[1];                 /* generation */
    vals[nv++] = v[2];                 /* publishTsNs */
    PyObject *exp_which = NULL, *gain_which = NULL, *zero = NULL, *zerof = NULL;
    if (has_crc)
        vals[nv++] = v[3];
    if (has_frame) {
        zero = PyLong_FromLong(0);
        zerof = PyFloat_FromDouble(0.0);
        exp_which = PyLong_FromUnsignedLongLong(v[6] == Py_None ? t[2] : t[3]);
        gain_which = PyLong_FromUnsignedLongLong(v[7] == Py_None ? t[4] : t[5]);
        if (!zero || !zerof || !exp_which || !gain_which)
            goto done;
        vals[nv++] = v[4];                                   /* frameId */
        vals[nv++] = v[5] == Py_None ? zero : v[5];          /* captureTsNs or 0 */
        vals[nv++] = exp_which;
        vals[nv++] = v[6] == Py_None ? zero : v[6];
        vals[nv++] = gain_which;
        vals[nv++] = v[7] == Py_None ? zerof : v[7];
    }
    if (extra != Py_None)
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(extra); i++)
            vals[nv++] = PyTuple_GET_ITEM(extra, i);
    if (PyTuple_GET_SIZE(table) != 6 + 2 * nv) {
        PyErr_SetString(PyExc_ValueError, "pack_header(): table does not match the plan");
        goto done;
    }
    unsigned char *dst = (unsigned char *)seg->base + base;
    memcpy(dst, PyBytes_AS_STRING(tmpl), tlen);
    res = 0;
    for (int i = 0; i < nv && res == 0; i++) {
        Py_ssize_t pos, code;
        if (get_ssize(PyTuple_GET_ITEM(table, 6 + 2 * i), &pos) < 0
                || get_ssize(PyTuple_GET_ITEM(table, 7 + 2 * i), &code) < 0) {
            res = -1;
            break;
        }
        int sz = scalar_size((int)code);
        if (sz == 0 || pos < 0 || pos + sz > tlen) {
            PyErr_SetString(PyExc_ValueError, "pack_header(): field outside the template");
            res = -1;
            break;
        }
        res = put_scalar(dst + pos, (int)code, vals[i]);
    }
done:
    Py_XDECREF(zero);
    Py_XDECREF(zerof);
    Py_XDECREF(exp_which);
    Py_XDECREF(gain_which);
    return res;
}

/* pack_header(seg, base, template, table, seq, gen, ts, crc, frame_id, capture,
 *             exposure, gain[, extra]) -> bool
 * A compiled HeaderPlan's SlotHeader (pycapnp's template with the per-message fields
 * patched) written at seg[base:]; table = (has_crc, has_frame, exp_unknown, exp_is,
 * gain_unknown, gain_is, then (position, struct code) per patched field in the plan's
 * order); extra: a tuple of values patched after those (a Receipt's scalars, in the
 * plan's order). False: a value does not fit its field, nothing is promised about the
 * bytes written (the slot is still odd) and the caller lets the Python plan raise. */
static PyObject *h_pack(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    if (n != 12 && n != 13) {
        PyErr_SetString(PyExc_TypeError, "pack_header() takes 12 or 13 arguments");
        return NULL;
    }
    Region *seg = as_region(a[0], "segment");
    if (seg == NULL)
        return NULL;
    Py_ssize_t base;
    if (get_ssize(a[1], &base) < 0)
        return NULL;
    int res = pack_core(seg, base, a[2], a[3], a + 4, n == 13 ? a[12] : Py_None);
    if (res < 0)
        return NULL;
    if (res)
        Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* publish_hot(hot, plan, slot, seq, ts, frame_id, capture, exposure, gain) -> ts, False
 * A stream's repeat publish in one call: `pack_header` (no CRC, no receipt), the
 * SlotLayout unless the slot holds these very bytes from this writer's last publish of
 * it, untouched since (the generation moved by exactly this loan), then `publish`, then
 * the writer's slot bookkeeping. hot = (seg, ctl, hdr, lay, events, leases, sent,
 * last_slot_off, last_seq_off, gens, seqs, loaned, slot_layout, slot_layout_gen): the
 * writer's constants and its own lists (the same objects its Python code uses), one
 * tuple so the call touches one object for them; plan = (template, table, ts_pos,
 * layout bytes). The generation is gens[slot] + 1 (the loan made it odd). The Python
 * path checked the description (Loan.array) and chose the plan; this only writes.
 * Every argument is checked before the first byte is written. False: a value does not
 * fit its field, nothing is published (the slot is still odd, still on loan) and the
 * caller takes the path that raises. After the stores nothing can fail: gens[slot],
 * seqs[slot], slot_layout[slot], slot_layout_gen[slot] are set and the slot leaves
 * `loaned` (the caller's last_seq and count follow; a slot no longer on loan says the
 * message went out). Between the publish stamp and the wake-up the writer otherwise
 * ran two calls and the lookups around them in Python, cold (a frame copied just
 * before evicts them): that was the bridge's writer part beyond iceoryx2's. */
enum { HOT_SEG, HOT_CTL, HOT_HDR, HOT_LAY, HOT_EVENTS, HOT_LEASES, HOT_SENT, HOT_LAST_SLOT,
       HOT_LAST_SEQ, HOT_GENS, HOT_SEQS, HOT_LOANED, HOT_SLOT_LAYOUT, HOT_SLOT_LAYOUT_GEN,
       HOT_LEN };
static PyObject *w_publish_hot(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    if (n != 9) {
        PyErr_SetString(PyExc_TypeError, "publish_hot() takes 9 arguments");
        return NULL;
    }
    PyObject *hot = a[0], *plan = a[1];
    if (!PyTuple_Check(hot) || PyTuple_GET_SIZE(hot) != HOT_LEN || !PyTuple_Check(plan)
            || PyTuple_GET_SIZE(plan) != 4) {
        PyErr_SetString(PyExc_TypeError, "publish_hot(): bad argument types");
        return NULL;
    }
    Region *seg = as_region(PyTuple_GET_ITEM(hot, HOT_SEG), "segment");
    if (seg == NULL)
        return NULL;
    PyObject *ctl = PyTuple_GET_ITEM(hot, HOT_CTL), *hdr = PyTuple_GET_ITEM(hot, HOT_HDR),
             *lay = PyTuple_GET_ITEM(hot, HOT_LAY), *sent_o = PyTuple_GET_ITEM(hot, HOT_SENT),
             *events = PyTuple_GET_ITEM(hot, HOT_EVENTS),
             *leases = PyTuple_GET_ITEM(hot, HOT_LEASES),
             *gens = PyTuple_GET_ITEM(hot, HOT_GENS), *seqs = PyTuple_GET_ITEM(hot, HOT_SEQS),
             *loaned = PyTuple_GET_ITEM(hot, HOT_LOANED),
             *slay = PyTuple_GET_ITEM(hot, HOT_SLOT_LAYOUT),
             *slay_gen = PyTuple_GET_ITEM(hot, HOT_SLOT_LAYOUT_GEN);
    if (!PyTuple_Check(ctl) || !PyTuple_Check(hdr) || !PyTuple_Check(lay)
            || !PyTuple_Check(leases) || !PyList_Check(gens) || !PyList_Check(seqs)
            || !PySet_Check(loaned) || !PyList_Check(slay) || !PyList_Check(slay_gen)) {
        PyErr_SetString(PyExc_TypeError, "publish_hot(): bad writer tables");
        return NULL;
    }
    Region *sent = NULL;
    if (sent_o != Py_None && (sent = as_region(sent_o, "sent")) == NULL)
        return NULL;
    Py_ssize_t slot, cb, base, lpos, ts_pos, last_slot_off, last_seq_off;
    uint64_t seq, gen, ts = 0, slay_g;
    if (get_ssize(a[2], &slot) < 0 || get_u64(a[3], &seq) < 0
            || (a[4] != Py_None && get_u64(a[4], &ts) < 0)
            || get_ssize(PyTuple_GET_ITEM(plan, 2), &ts_pos) < 0
            || get_ssize(PyTuple_GET_ITEM(hot, HOT_LAST_SLOT), &last_slot_off) < 0
            || get_ssize(PyTuple_GET_ITEM(hot, HOT_LAST_SEQ), &last_seq_off) < 0)
        return NULL;
    if (slot < 0 || slot >= PyTuple_GET_SIZE(ctl) || slot >= PyTuple_GET_SIZE(hdr)
            || slot >= PyTuple_GET_SIZE(lay) || slot >= PyList_GET_SIZE(gens)
            || slot >= PyList_GET_SIZE(seqs) || slot >= PyList_GET_SIZE(slay)
            || slot >= PyList_GET_SIZE(slay_gen)) {
        PyErr_SetString(PyExc_ValueError, "publish_hot(): slot outside the tables");
        return NULL;
    }
    int on_loan = PySet_Contains(loaned, a[2]);
    if (on_loan < 0)
        return NULL;
    if (!on_loan) {
        PyErr_SetString(PyExc_ValueError, "publish_hot(): slot not on loan");
        return NULL;
    }
    if (get_ssize(PyTuple_GET_ITEM(ctl, slot), &cb) < 0
            || get_ssize(PyTuple_GET_ITEM(hdr, slot), &base) < 0
            || get_ssize(PyTuple_GET_ITEM(lay, slot), &lpos) < 0
            || get_u64(PyList_GET_ITEM(gens, slot), &gen) < 0)
        return NULL;
    if (!(gen & 1) || gen == UINT64_MAX) {
        PyErr_SetString(PyExc_ValueError, "publish_hot(): slot generation is not odd");
        return NULL;
    }
    gen += 1;
    PyObject *tmpl = PyTuple_GET_ITEM(plan, 0), *raw_l = PyTuple_GET_ITEM(plan, 3);
    if (!PyBytes_Check(tmpl) || !PyBytes_Check(raw_l)) {
        PyErr_SetString(PyExc_TypeError, "publish_hot(): bad plan");
        return NULL;
    }
    PyObject *sg = PyList_GET_ITEM(slay_gen, slot);
    int fresh = PyList_GET_ITEM(slay, slot) != raw_l || !PyLong_Check(sg);
    if (!fresh) {
        slay_g = PyLong_AsUnsignedLongLong(sg);
        if (slay_g == (uint64_t)-1 && PyErr_Occurred())
            PyErr_Clear();
        fresh = slay_g != gen - 2;
    }
    Py_ssize_t hlen = PyBytes_GET_SIZE(tmpl), nl = PyBytes_GET_SIZE(raw_l);
    if (check_events(events) < 0)
        return NULL;
    if (fresh && (!seg->writable || !in_bounds(seg, lpos, nl))) {
        PyErr_SetString(PyExc_ValueError, "publish_hot(): layout outside the segment");
        return NULL;
    }
    if (ts_pos < 0 || ts_pos + 8 > hlen || !in_bounds(seg, base, hlen)
            || !in_bounds(seg, cb, 32) || cb % 8 || !in_bounds(seg, last_slot_off, 4)
            || !in_bounds(seg, last_seq_off, 8) || last_slot_off % 4 || last_seq_off % 8) {
        PyErr_SetString(PyExc_ValueError, "publish_hot(): offsets outside the segment");
        return NULL;
    }
    if (sent != NULL && (!sent->writable || sent->len < 8 * PyTuple_GET_SIZE(events))) {
        PyErr_SetString(PyExc_ValueError,
                        "publish(): sent must be writable, 8 bytes per reader");
        return NULL;
    }
    /* The objects the bookkeeping stores, made before the first store. */
    PyObject *gen_o = PyLong_FromUnsignedLongLong(gen);
    PyObject *zero = PyLong_FromLong(0);
    if (gen_o == NULL || zero == NULL) {
        Py_XDECREF(gen_o);
        Py_XDECREF(zero);
        return NULL;
    }
    /* The header's publishTsNs is written by publish_core below (0 until then). */
    PyObject *v[8] = {a[3], gen_o, a[4] == Py_None ? zero : a[4], Py_None,
                      a[5], a[6], a[7], a[8]};
    int res = pack_core(seg, base, tmpl, PyTuple_GET_ITEM(plan, 1), v, Py_None);
    Py_DECREF(zero);
    if (res != 0) {
        Py_DECREF(gen_o);
        if (res < 0)
            return NULL;
        Py_RETURN_FALSE;
    }
    if (fresh)
        memcpy(seg->base + lpos, PyBytes_AS_STRING(raw_l), nl);
    if (publish_core(seg, cb, seq, gen, a[4] != Py_None, &ts, base + ts_pos,
                     (uint64_t)hlen, (uint64_t)nl, last_slot_off, last_seq_off, slot,
                     events, leases, sent) < 0) {
        Py_DECREF(gen_o);
        return NULL;
    }
    PyObject *out = PyLong_FromUnsignedLongLong(ts);
    /* Published: the writer's lists (nothing here can fail but the result's int). */
    Py_INCREF(gen_o);
    PyList_SetItem(gens, slot, gen_o);                  /* steal */
    PyList_SetItem(slay_gen, slot, gen_o);              /* steal the second reference */
    Py_INCREF(a[3]);
    PyList_SetItem(seqs, slot, a[3]);
    Py_INCREF(raw_l);
    PyList_SetItem(slay, slot, raw_l);
    if (PySet_Discard(loaned, a[2]) < 0)
        PyErr_Clear();                                  /* an int: cannot fail */
    return out;
}

static PyObject *h_accept(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    uint64_t want_seq, want_gen, now, last_capture;
    if (n != 7) {
        PyErr_SetString(PyExc_TypeError, "accept() takes 7 arguments");
        return NULL;
    }
    if (get_u64(a[3], &want_seq) < 0 || get_u64(a[4], &want_gen) < 0
            || get_u64(a[5], &now) < 0 || get_u64(a[6], &last_capture) < 0)
        return NULL;
    return accept_core(a[0], a[1], a[2], want_seq, want_gen, now, last_capture, NULL);
}

/* ------------------------------------------------------------- native receive */

/* The reader's hot path as objects (round 8 in docs/ipc-wakeups.md): a ReaderCore holds
 * one reader's constants (its regions, every slot's offsets as C arrays, the compiled
 * header table and check context), bound once, where `take` was given 18 arguments per
 * call; its try_receive is `take` plus the reader's bookkeeping and a Message built in
 * C. MessageBase is that Message's storage, with `array` and `release` in C (the
 * Python class supervisor.ipc._message.Message derives from it and adds the rest).
 *
 * What it decides alone is only the common case: a message in the layout the reader
 * validated last, that `accept` passes whole, its CRC (if the channel has one)
 * confirmed here, no cadence or burst configured, no test hook in place. Everything
 * else goes to the reader's Python methods, unchanged: Reader._try_receive_native (a
 * hook, no lease free, state it does not recognise) or Reader._took (anything the take
 * found and did not accept itself: a new layout, a header `accept` left to Python, a
 * CRC not confirmed, a sequence past SEQ_HONEST). Likewise a Message's `array` and
 * `release` call its Python `check()` for anything but a slot still stable and held.
 *
 * The reader's mutable state stays in its __dict__ (one truth for both paths: the
 * Python code, the rehearsal's save and restore, tests), read and written here by
 * interned name. Only the segment's Region (read-only) is read; the only stores are
 * into this reader's own lease table. Every offset is checked against the regions
 * once, at construction, and again (cheap comparisons) where it is used. */

static PyObject *S_ntake, *S_naccept, *S_cadence, *S_burst, *S_last_seq, *S_free_leases,
    *S_last_capture, *S_last_take, *S_last_layout, *S_received, *S_rejected, *S_dropped,
    *S_pos, *S_delivered, *S_views, *S_drop_lease, *S_check, *S_kept_array, *S_view,
    *S_py_array, *S_py_release, *S_one, *S_zero, *S_release, *S_took_m;

typedef struct {
    PyObject_HEAD
    PyObject *reader, *rdict, *seg_o, *lease_o, *take_fn, *accept_fn, *compiled, *ctx;
    PyObject *msg_type, *fallback, *took;
    PyObject *last_take;      /* the reader's _last_take parsed last (by identity) */
    PyObject *last_raw;       /* its layout bytes; NULL: none */
    Py_ssize_t span_lo, span_hi;
    Py_ssize_t count, hdr_max, lay_max, last_seq_off, last_slot_off, retries;
    Py_ssize_t *off;          /* ctl, hdr, lay, pay: count each */
    uint64_t lease_ns, seq_honest;
    int need_crc;
    uint64_t cvals[14];       /* ctx's integers, read once (ctx is an immutable tuple) */
    PyObject *key;            /* the compiled table's key looked up last (its hash kept) */
    PyObject *plan_st;        /* the compiled entry `plan` was read from (identity) */
    Plan plan;
} Core;

typedef struct {
    PyObject_HEAD
    PyObject *reader, *core, *layout, *stamp, *array, *raw_header, *receipt;
    Py_ssize_t slot, lease;
    unsigned long long gen;
    char released, lost;
} Msg;

static PyTypeObject CoreType, MsgType;

static int core_traverse(Core *c, visitproc visit, void *arg) {
    Py_VISIT(c->reader); Py_VISIT(c->rdict); Py_VISIT(c->seg_o); Py_VISIT(c->lease_o);
    Py_VISIT(c->take_fn); Py_VISIT(c->accept_fn); Py_VISIT(c->compiled); Py_VISIT(c->ctx);
    Py_VISIT(c->msg_type); Py_VISIT(c->fallback); Py_VISIT(c->took);
    Py_VISIT(c->last_take); Py_VISIT(c->last_raw); Py_VISIT(c->key); Py_VISIT(c->plan_st);
    return 0;
}

static int core_clear(Core *c) {
    Py_CLEAR(c->reader); Py_CLEAR(c->rdict); Py_CLEAR(c->seg_o); Py_CLEAR(c->lease_o);
    Py_CLEAR(c->take_fn); Py_CLEAR(c->accept_fn); Py_CLEAR(c->compiled); Py_CLEAR(c->ctx);
    Py_CLEAR(c->msg_type); Py_CLEAR(c->fallback); Py_CLEAR(c->took);
    Py_CLEAR(c->last_take); Py_CLEAR(c->last_raw); Py_CLEAR(c->key); Py_CLEAR(c->plan_st);
    return 0;
}

static void core_dealloc(Core *c) {
    PyObject_GC_UnTrack(c);
    core_clear(c);
    PyMem_Free(c->off);
    c->off = NULL;
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int offsets_into(PyObject *t, Py_ssize_t count, Py_ssize_t *out, const char *what) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != count) {
        PyErr_Format(PyExc_TypeError, "ReaderCore(): %s must be a tuple of %zd offsets",
                     what, count);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        if (get_ssize(PyTuple_GET_ITEM(t, i), &out[i]) < 0)
            return -1;
    return 0;
}

/* ReaderCore(reader, seg, lease, ctl, hdr, lay, pay, hdr_max, lay_max, last_seq_off,
 *            last_slot_off, retries, lease_ns, seq_honest, compiled, ctx, take, accept,
 *            message_type) */
static int core_init(Core *c, PyObject *args, PyObject *kw) {
    PyObject *reader, *seg_o, *lease_o, *ctl, *hdr, *lay, *pay, *compiled, *ctx, *take,
        *accept, *mtype;
    Py_ssize_t hdr_max, lay_max, lso, lslo, retries;
    unsigned long long lease_ns, seq_honest;
    if (c->off != NULL) {
        PyErr_SetString(PyExc_TypeError, "ReaderCore is initialised once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OO!O!OOOOnnnnnKKO!O!OOO!:ReaderCore", &reader,
                          &RegionType, &seg_o, &RegionType, &lease_o, &ctl, &hdr, &lay,
                          &pay, &hdr_max, &lay_max, &lso, &lslo, &retries, &lease_ns,
                          &seq_honest, &PyDict_Type, &compiled, &PyTuple_Type, &ctx,
                          &take, &accept, &PyType_Type, &mtype))
        return -1;
    Region *seg = (Region *)seg_o, *lease = (Region *)lease_o;
    if (!PyType_IsSubtype((PyTypeObject *)mtype, &MsgType)) {
        PyErr_SetString(PyExc_TypeError, "ReaderCore(): message_type must derive from "
                        "MessageBase");
        return -1;
    }
    if (PyTuple_GET_SIZE(ctx) != CTX_LEN) {
        PyErr_SetString(PyExc_TypeError, "ReaderCore(): bad ctx");
        return -1;
    }
    if (seg->base == NULL || lease->base == NULL || !lease->writable) {
        PyErr_SetString(PyExc_ValueError, "ReaderCore(): regions released, or the lease "
                        "table read-only");
        return -1;
    }
    Py_ssize_t count = PyTuple_Check(ctl) ? PyTuple_GET_SIZE(ctl) : -1;
    if (count < 1 || count > MAX_SLOTS || hdr_max < 0 || lay_max < 0 || retries < 0) {
        PyErr_SetString(PyExc_ValueError, "ReaderCore(): bad slot count or limits");
        return -1;
    }
    Py_ssize_t *off = PyMem_Calloc(4 * (size_t)count, sizeof(Py_ssize_t));
    if (off == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (offsets_into(ctl, count, off, "ctl") < 0
            || offsets_into(hdr, count, off + count, "hdr") < 0
            || offsets_into(lay, count, off + 2 * count, "lay") < 0
            || offsets_into(pay, count, off + 3 * count, "pay") < 0) {
        PyMem_Free(off);
        return -1;
    }
    int ok = in_bounds(seg, lso, 8) && lso % 8 == 0 && in_bounds(seg, lslo, 4)
        && lslo % 4 == 0 && in_bounds(lease, TAKEN_OFF, 8);
    for (Py_ssize_t i = 0; ok && i < count; i++)
        ok = in_bounds(seg, off[i], 32) && off[i] % 8 == 0
            && in_bounds(seg, off[count + i], hdr_max)
            && in_bounds(seg, off[2 * count + i], lay_max)
            && in_bounds(seg, off[3 * count + i], 0);
    if (!ok) {
        PyMem_Free(off);
        PyErr_SetString(PyExc_ValueError, "ReaderCore(): offsets outside the mappings");
        return -1;
    }
    if (ctx_values(ctx, c->cvals) < 0) {
        PyMem_Free(off);
        return -1;
    }
    PyObject *rdict = PyObject_GenericGetDict(reader, NULL);
    if (rdict == NULL) {
        PyMem_Free(off);
        return -1;
    }
    PyObject *fallback = PyObject_GetAttrString(reader, "_try_receive_native");
    PyObject *took = fallback ? PyObject_GetAttrString(reader, "_took") : NULL;
    if (took == NULL) {
        Py_XDECREF(fallback);
        Py_DECREF(rdict);
        PyMem_Free(off);
        return -1;
    }
    c->off = off;
    c->count = count;
    c->hdr_max = hdr_max;
    c->lay_max = lay_max;
    c->last_seq_off = lso;
    c->last_slot_off = lslo;
    c->retries = retries;
    c->lease_ns = lease_ns;
    c->seq_honest = seq_honest;
    c->need_crc = need_crc_of(ctx);
    c->reader = Py_NewRef(reader);
    c->rdict = rdict;
    c->seg_o = Py_NewRef(seg_o);
    c->lease_o = Py_NewRef(lease_o);
    c->compiled = Py_NewRef(compiled);
    c->ctx = Py_NewRef(ctx);
    c->take_fn = Py_NewRef(take);
    c->accept_fn = Py_NewRef(accept);
    c->msg_type = Py_NewRef(mtype);
    c->fallback = fallback;
    c->took = took;
    return 0;
}

/* The u64 value of an exact int, or 0 (not one: the Python path decides). */
static int exact_u64(PyObject *o, uint64_t *out) {
    if (o == NULL || !PyLong_CheckExact(o))
        return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return 1;
}

/* The reader's _last_take, parsed when it is not the tuple parsed last: 0, or -1 (not
 * the shape the reader writes: the Python path decides). */
static int core_last_take(Core *c, PyObject *lt) {
    if (lt == c->last_take)
        return 0;
    PyObject *raw = NULL;
    Py_ssize_t lo = 0, hi = 0;
    if (lt != Py_None) {
        if (!PyTuple_CheckExact(lt) || PyTuple_GET_SIZE(lt) != 3
                || !PyBytes_CheckExact(PyTuple_GET_ITEM(lt, 0)))
            return -1;
        lo = PyLong_AsSsize_t(PyTuple_GET_ITEM(lt, 1));
        hi = PyLong_AsSsize_t(PyTuple_GET_ITEM(lt, 2));
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
        if (lo < 0 || hi < lo)
            return -1;
        raw = PyTuple_GET_ITEM(lt, 0);
    }
    Py_XSETREF(c->last_take, Py_NewRef(lt));
    Py_XSETREF(c->last_raw, Py_XNewRef(raw));
    c->span_lo = lo;
    c->span_hi = hi;
    return 0;
}

/* accept_core for this reader: its ctx's integers read once, the compiled entry's plan
 * reread only when the entry found is another object; the lookup itself is made every
 * time (the entry is whatever the table holds now), with the key object kept when the
 * 16 bytes repeat (its hash cached). */
static PyObject *core_accept(Core *c, PyObject *rawo, uint64_t want_seq, uint64_t want_gen,
                             uint64_t now, uint64_t last_capture, PyObject **receipt) {
    const unsigned char *raw = (const unsigned char *)PyBytes_AS_STRING(rawo);
    Py_ssize_t len = PyBytes_GET_SIZE(rawo);
    if (len < 16)
        Py_RETURN_NONE;
    if (c->key == NULL || memcmp(PyBytes_AS_STRING(c->key), raw, 16) != 0) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)raw, 16);
        if (key == NULL)
            return NULL;
        Py_XSETREF(c->key, key);
    }
    PyObject *st = PyDict_GetItemWithError(c->compiled, c->key);   /* borrowed */
    if (st == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    if (st != c->plan_st) {
        Plan plan;
        int got = plan_of(st, &plan);
        if (got <= 0)
            return got < 0 ? NULL : Py_NewRef(Py_None);
        c->plan = plan;
        Py_XSETREF(c->plan_st, Py_NewRef(st));
    }
    return accept_plan(&c->plan, c->cvals, c->ctx, raw, len, want_seq, want_gen, now,
                       last_capture, receipt);
}

static inline PyObject *dget(PyObject *d, PyObject *k) {
    return PyDict_GetItemWithError(d, k);     /* borrowed; str keys raise nothing */
}

/* Lease k given back (L4) and k put back on the free list, after a failure past the
 * pop: as Reader._drop_lease. */
static void core_unlease(Core *c, PyObject *free, Py_ssize_t k) {
    Region *lr = (Region *)c->lease_o;
    Py_ssize_t off = lease_offset(lr, k);
    if (off >= 0 && in_bounds(lr, off, LEASE_STRIDE))
        __atomic_store_n((uint64_t *)(lr->base + off + 8), 0, RELEASE);
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *ko = PyLong_FromSsize_t(k);
    if (ko != NULL) {
        if (PySequence_Contains(free, ko) == 0)
            PyList_Append(free, ko);
        Py_DECREF(ko);
    }
    PyErr_Clear();
    PyErr_Restore(et, ev, tb);
}

/* The fast path's bookkeeping, as Reader._try_receive_native then Reader._message do
 * it: dropped, last_seq, last_capture, the position (OFF_TAKEN), received, delivered.
 * 0, or -1 with an exception set. */
static int core_account(Core *c, PyObject *d, uint64_t last_seq, uint64_t seq,
                        Py_ssize_t slot, uint64_t gen, PyObject *stamp) {
    PyObject *received = dget(d, S_received), *rejected = dget(d, S_rejected);
    if (received == NULL || rejected == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "reader state missing");
        return -1;
    }
    Py_INCREF(received);
    uint64_t gap = seq - last_seq - 1;
    int rc = -1;
    PyObject *seq_o = PyLong_FromUnsignedLongLong(seq), *tmp = NULL, *gap_o = NULL;
    if (seq_o == NULL)
        goto done;
    if (gap) {
        int any = PyObject_IsTrue(received);
        if (any == 0)
            any = PyObject_IsTrue(rejected);
        if (any < 0)
            goto done;
        if (any) {
            PyObject *dropped = dget(d, S_dropped);
            gap_o = PyLong_FromUnsignedLongLong(gap);
            if (dropped == NULL || gap_o == NULL)
                goto done;
            tmp = PyNumber_Add(dropped, gap_o);
            if (tmp == NULL || PyDict_SetItem(d, S_dropped, tmp) < 0)
                goto done;
            Py_CLEAR(tmp);
        }
    }
    if (PyDict_SetItem(d, S_last_seq, seq_o) < 0)
        goto done;
    PyObject *capture = PyTuple_GET_ITEM(stamp, 6);
    if (capture != Py_None && PyDict_SetItem(d, S_last_capture, capture) < 0)
        goto done;
    uint64_t pos;
    if (!exact_u64(dget(d, S_pos), &pos) || seq > pos) {
        if (PyDict_SetItem(d, S_pos, seq_o) < 0)
            goto done;
        Region *lr = (Region *)c->lease_o;
        if (!in_bounds(lr, TAKEN_OFF, 8)) {
            PyErr_SetString(PyExc_ValueError, "lease table released");
            goto done;
        }
        __atomic_store_n((uint64_t *)(lr->base + TAKEN_OFF), seq, RELAXED);
    }
    tmp = PyNumber_Add(received, S_one);
    if (tmp == NULL || PyDict_SetItem(d, S_received, tmp) < 0)
        goto done;
    Py_CLEAR(tmp);
    tmp = Py_BuildValue("(OnK)", seq_o, slot, (unsigned long long)gen);
    if (tmp == NULL || PyDict_SetItem(d, S_delivered, tmp) < 0)
        goto done;
    rc = 0;
done:
    Py_XDECREF(tmp);
    Py_XDECREF(gap_o);
    Py_XDECREF(seq_o);
    Py_DECREF(received);
    return rc;
}

static PyObject *core_try_receive(Core *c, PyObject *unused) {
    PyObject *d = c->rdict;
    if (d == NULL || c->off == NULL) {
        PyErr_SetString(PyExc_ValueError, "ReaderCore not initialised or cleared");
        return NULL;
    }
    Region *seg = (Region *)c->seg_o, *lease = (Region *)c->lease_o;
    uint64_t last_seq, last_capture;
    /* A hook in place (tests replace the take or the check), a cadence (its bookkeeping
     * is Python's), released regions, state not as the reader writes it: the Python
     * path, which decides (and raises what it raises). A burst (spin_us) stays here: its
     * one step per message, Burst.took(now), is called below as _message calls it. */
    if (seg->base == NULL || lease->base == NULL
            || dget(d, S_ntake) != c->take_fn || dget(d, S_naccept) != c->accept_fn
            || dget(d, S_cadence) != Py_None
            || !exact_u64(dget(d, S_last_seq), &last_seq)
            || !exact_u64(dget(d, S_last_capture), &last_capture))
        return PyObject_CallNoArgs(c->fallback);
    if (last_seq == UINT64_MAX)
        Py_RETURN_NONE;     /* nothing can be newer (a hostile writer's last word) */
    char *b = seg->base;
    /* The look for nothing: R1 and the take's own comparison (round 6). */
    if (__atomic_load_n((uint64_t *)(b + c->last_seq_off), ACQUIRE) <= last_seq)
        Py_RETURN_NONE;
    PyObject *free = dget(d, S_free_leases);
    if (free == NULL || !PyList_CheckExact(free) || PyList_GET_SIZE(free) == 0
            || core_last_take(c, dget(d, S_last_take)) < 0)
        return PyObject_CallNoArgs(c->fallback);    /* no lease free: it raises, or None */
    Py_ssize_t nfree = PyList_GET_SIZE(free);
    Py_ssize_t k = PyLong_AsSsize_t(PyList_GET_ITEM(free, nfree - 1));
    Py_ssize_t lease_off = lease_offset(lease, k);
    if ((k == -1 && PyErr_Occurred()) || lease_off < 0
            || !in_bounds(lease, lease_off, LEASE_STRIDE)) {
        PyErr_Clear();
        return PyObject_CallNoArgs(c->fallback);
    }
    Py_INCREF(free);
    PyObject *last_raw = Py_XNewRef(c->last_raw);
    Py_ssize_t span_lo = c->span_lo, span_hi = c->span_hi;
    PyObject *out = NULL;
    const Py_ssize_t count = c->count, *ctl = c->off, *hdr = c->off + count,
        *lay = c->off + 2 * count, *pay = c->off + 3 * count;
    uint64_t want = last_seq + 1, deadline = monotonic_ns() + c->lease_ns;
    for (Py_ssize_t attempt = 0; attempt < c->retries; attempt++) {
        uint64_t latest = __atomic_load_n((uint64_t *)(b + c->last_seq_off), ACQUIRE); /* R1 */
        if (latest < want)
            break;
        uint32_t hint = __atomic_load_n((uint32_t *)(b + c->last_slot_off), RELAXED);
        Py_ssize_t slot = -1, cb = 0;
        uint64_t g1 = 0, seq = 0;
        if (hint < (uint64_t)count) {
            cb = ctl[hint];
            g1 = __atomic_load_n((uint64_t *)(b + cb), ACQUIRE);                   /* R2 */
            seq = __atomic_load_n((uint64_t *)(b + cb + 8), RELAXED);
            if (seq == want && !(g1 & 1))
                slot = hint;
        }
        if (slot < 0) {
            uint64_t best_seq = 0;
            for (Py_ssize_t i = 0; i < count; i++) {
                uint64_t g = __atomic_load_n((uint64_t *)(b + ctl[i]), ACQUIRE);   /* R2 */
                uint64_t s = __atomic_load_n((uint64_t *)(b + ctl[i] + 8), RELAXED);
                if (!(g & 1) && s >= want && (slot < 0 || s < best_seq)) {
                    slot = i;
                    best_seq = s;
                    g1 = g;
                    cb = ctl[i];
                }
            }
            if (slot < 0)
                break;
            seq = best_seq;
        }
        uint32_t hlen = __atomic_load_n((uint32_t *)(b + cb + 24), RELAXED);
        uint32_t llen = __atomic_load_n((uint32_t *)(b + cb + 28), RELAXED);
        /* Lengths from the writer, capped by the areas checked at construction. */
        Py_ssize_t hn = hlen < (uint64_t)c->hdr_max ? (Py_ssize_t)hlen : c->hdr_max;
        Py_ssize_t ln = llen < (uint64_t)c->lay_max ? (Py_ssize_t)llen : c->lay_max;
        if (!in_bounds(seg, hdr[slot], hn) || !in_bounds(seg, lay[slot], ln)) {
            PyErr_SetString(PyExc_ValueError, "try_receive(): slot offsets outside the segment");
            goto out;
        }
        char *e = lease->base + lease_off;
        __atomic_store_n((uint32_t *)e, (uint32_t)slot, RELAXED);                 /* L1 */
        __atomic_store_n((uint64_t *)(e + 16), deadline, RELAXED);
        __atomic_store_n((uint64_t *)(e + 8), g1, RELEASE);                        /* L2 */
        __atomic_thread_fence(SEQ_CST);                                            /* L3 */
        PyObject *raw_h = PyBytes_FromStringAndSize(b + hdr[slot], hn);            /* R3 */
        /* The layout compared in place (plain loads, judged by R5 like the copy); its
         * bytes are copied only when they differ (the Python path then decodes them). */
        int same = raw_h != NULL && last_raw != NULL && PyBytes_GET_SIZE(last_raw) == ln
            && memcmp(PyBytes_AS_STRING(last_raw), b + lay[slot], ln) == 0;
        PyObject *raw_l = raw_h != NULL && !same
            ? PyBytes_FromStringAndSize(b + lay[slot], ln) : NULL;
        __atomic_thread_fence(ACQUIRE);                                            /* R4 */
        uint64_t g2 = __atomic_load_n((uint64_t *)(b + cb), RELAXED);              /* R5 */
        if (raw_h == NULL || (!same && raw_l == NULL) || g2 != g1) {
            __atomic_store_n((uint64_t *)(e + 8), 0, RELEASE);                     /* L4 */
            Py_XDECREF(raw_h);
            Py_XDECREF(raw_l);
            if (PyErr_Occurred())
                goto out;
            continue;   /* the writer took the slot while we leased it: look again */
        }
        if (same)
            raw_l = Py_NewRef(last_raw);
        PyObject *stamp, *receipt = NULL;
        int crc_ok = 0;
        if (same)
            stamp = core_accept(c, raw_h, seq, g1, monotonic_ns(), last_capture, &receipt);
        else
            stamp = Py_NewRef(Py_None);
        if (stamp != NULL && stamp != Py_None && PyTuple_GET_ITEM(stamp, 4) != Py_None
                && c->need_crc && in_bounds(seg, pay[slot] + span_lo, span_hi - span_lo)) {
            /* The payload against the header's CRC-32, then the seqlock again (as take). */
            const Bytef *p = (const Bytef *)(b + pay[slot] + span_lo);
            uLong crc = crc32_z(crc32(0L, Z_NULL, 0), p, (z_size_t)(span_hi - span_lo));
            __atomic_thread_fence(ACQUIRE);                                        /* R4 */
            uint64_t g3 = __atomic_load_n((uint64_t *)(b + cb), RELAXED);          /* R5 */
            unsigned long want_crc = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(stamp, 4));
            if (want_crc == (unsigned long)-1 && PyErr_Occurred())
                Py_CLEAR(stamp);
            else
                crc_ok = g3 == g1 && crc == want_crc;
        }
        if (stamp == NULL) {
            __atomic_store_n((uint64_t *)(e + 8), 0, RELEASE);
            Py_DECREF(raw_h);
            Py_DECREF(raw_l);
            Py_XDECREF(receipt);
            goto out;
        }
        if (receipt == NULL)
            receipt = Py_NewRef(PyTuple_GET_ITEM(c->ctx, CTX_SLOW));
        PyObject *layout = dget(d, S_last_layout);
        int fast = stamp != Py_None && seq < c->seq_honest && layout != NULL
            && (crc_ok || !c->need_crc || PyTuple_GET_ITEM(stamp, 4) == Py_None);
        /* The lease is the reader's now (Reader._try_receive_native's free.pop()). */
        if (PyList_SetSlice(free, nfree - 1, nfree, NULL) < 0) {
            __atomic_store_n((uint64_t *)(e + 8), 0, RELEASE);
            Py_DECREF(raw_h);
            Py_DECREF(raw_l);
            Py_DECREF(stamp);
            Py_DECREF(receipt);
            goto out;
        }
        if (!fast) {
            out = PyObject_CallFunction(c->took, "nKKNNNNin", slot, (unsigned long long)g1,
                                        (unsigned long long)seq, raw_h, raw_l, stamp,
                                        receipt, crc_ok, k);
            goto out;
        }
        Py_DECREF(raw_l);
        Py_INCREF(layout);
        if (core_account(c, d, last_seq, seq, slot, g1, stamp) < 0) {
            core_unlease(c, free, k);
            Py_DECREF(layout);
            Py_DECREF(raw_h);
            Py_DECREF(stamp);
            Py_DECREF(receipt);
            goto out;
        }
        PyTypeObject *mt = (PyTypeObject *)c->msg_type;
        Msg *msg = (Msg *)mt->tp_alloc(mt, 0);
        if (msg == NULL) {
            core_unlease(c, free, k);
            Py_DECREF(layout);
            Py_DECREF(raw_h);
            Py_DECREF(stamp);
            Py_DECREF(receipt);
            goto out;
        }
        msg->reader = Py_NewRef(c->reader);
        msg->core = Py_NewRef((PyObject *)c);
        msg->layout = layout;
        msg->stamp = stamp;
        msg->raw_header = raw_h;
        msg->receipt = receipt;
        msg->array = Py_NewRef(Py_None);
        msg->slot = slot;
        msg->lease = k;
        msg->gen = g1;
        msg->released = msg->lost = 0;
        out = (PyObject *)msg;
        PyObject *burst = dget(d, S_burst);
        if (burst != NULL && burst != Py_None) {
            PyObject *now = PyLong_FromUnsignedLongLong(monotonic_ns());
            PyObject *r = now ? PyObject_CallMethodOneArg(burst, S_took_m, now) : NULL;
            Py_XDECREF(now);
            if (r == NULL) {            /* the message is the caller's; the error too */
                Py_CLEAR(out);
                goto out;
            }
            Py_DECREF(r);
        }
        goto out;
    }
    out = Py_NewRef(Py_None);
out:
    Py_DECREF(free);
    Py_XDECREF(last_raw);
    return out;
}

static PyMethodDef core_methods[] = {
    {"try_receive", (PyCFunction)core_try_receive, METH_NOARGS,
     "Reader.try_receive on the native path (see _native.c, native receive)"},
    {NULL}
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "supervisor.ipc._native.ReaderCore",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One reader's receive path with its constants bound (built by Reader)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)core_init,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_methods = core_methods,
};

/* ---- MessageBase */

static int msg_traverse(Msg *m, visitproc visit, void *arg) {
    Py_VISIT(m->reader); Py_VISIT(m->core); Py_VISIT(m->layout); Py_VISIT(m->stamp);
    Py_VISIT(m->array); Py_VISIT(m->raw_header); Py_VISIT(m->receipt);
    return 0;
}

static int msg_clear(Msg *m) {
    Py_CLEAR(m->reader); Py_CLEAR(m->core); Py_CLEAR(m->layout); Py_CLEAR(m->stamp);
    Py_CLEAR(m->array); Py_CLEAR(m->raw_header); Py_CLEAR(m->receipt);
    return 0;
}

static void msg_finalize(Msg *m);

static void msg_dealloc(Msg *m) {
    if (PyObject_CallFinalizerFromDealloc((PyObject *)m) < 0)
        return;                                         /* resurrected */
    PyObject_GC_UnTrack(m);
    msg_clear(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

/* The message's core when the fast checks may run: built by a native reader whose
 * regions are live and the slot is one of its slots; else NULL (the Python methods). */
static inline Core *msg_core(Msg *m) {
    Core *c = (Core *)m->core;
    if (c == NULL || Py_TYPE(c) != &CoreType || c->off == NULL || c->rdict == NULL
            || ((Region *)c->seg_o)->base == NULL || ((Region *)c->lease_o)->base == NULL
            || m->slot < 0 || m->slot >= c->count)
        return NULL;
    return c;
}

/* A message dropped without release() (an exception between the take and the with,
 * a KeyboardInterrupt, a caller that forgot): its lease is given back here, as release's
 * own store would (L4), without the seqlock check (nothing of it is read any more). It
 * had kept the lease for ever: after max_leases such drops every take raised "all
 * leases are held" (red team 15 rows 1, 14). Errors are swallowed: a finalizer has no
 * caller to tell, and a reader already closed has no lease table to give back to. */
static void msg_finalize(Msg *m) {
    if (m->released || m->lost || m->lease < 0 || m->reader == NULL)
        return;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    m->released = 1;
    Core *c = msg_core(m);
    PyObject *d = c != NULL ? c->rdict : NULL;
    PyObject *free = d != NULL ? dget(d, S_free_leases) : NULL;
    Region *lr = c != NULL ? (Region *)c->lease_o : NULL;
    if (c != NULL && dget(d, S_drop_lease) == NULL && free != NULL && PyList_CheckExact(free)
            && lease_offset(lr, m->lease) >= 0)
        core_unlease(c, free, m->lease);               /* L4, k back on the free list */
    else {
        PyObject *r = PyObject_CallMethod(m->reader, "_drop_lease", "n", m->lease);
        Py_XDECREF(r);
    }
    PyErr_Clear();
    PyErr_Restore(et, ev, tb);
}

static int msg_check(Msg *m) {
    PyObject *r = PyObject_CallMethodNoArgs((PyObject *)m, S_check);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* Message.array: the Python property's steps (_message.py), with the seqlock look (R2)
 * and the per-slot cache read here; anything but a held, stable slot goes to check(). */
static PyObject *msg_array(Msg *m, void *unused) {
    Core *c = msg_core(m);
    if (c == NULL)
        return PyObject_CallMethodNoArgs((PyObject *)m, S_py_array);
    Py_INCREF(c);
    PyObject *out = NULL, *kept = NULL;
    char *b = ((Region *)c->seg_o)->base;
    if ((m->released || m->lost
         || __atomic_load_n((uint64_t *)(b + c->off[m->slot]), ACQUIRE) != m->gen)  /* R2 */
            && msg_check(m) < 0)
        goto done;
    PyObject *views = dget(c->rdict, S_views);
    if (views != NULL && PyList_CheckExact(views) && m->slot < PyList_GET_SIZE(views)) {
        PyObject *t = PyList_GET_ITEM(views, m->slot);
        if (PyTuple_CheckExact(t) && PyTuple_GET_SIZE(t) == 2
                && PyTuple_GET_ITEM(t, 0) == m->layout)
            kept = Py_NewRef(PyTuple_GET_ITEM(t, 1));
    }
    if (kept == NULL && (kept = PyObject_CallMethodNoArgs((PyObject *)m, S_kept_array)) == NULL)
        goto done;
    if (m->array == NULL || m->array == Py_None) {     /* Python writes None there */
        PyObject *v = PyObject_CallMethodNoArgs(kept, S_view);
        if (v == NULL)
            goto done;
        Py_XSETREF(m->array, v);
    }
    out = Py_NewRef(m->array);
done:
    Py_XDECREF(kept);
    Py_DECREF(c);
    return out;
}

/* Message.release: the lease given back (L4) after the seqlock check (R4 + R5). */
static PyObject *msg_release(Msg *m, PyObject *unused) {
    Core *c = msg_core(m);
    if (c == NULL)
        return PyObject_CallMethodNoArgs((PyObject *)m, S_py_release);
    if (m->released && !m->lost)
        Py_RETURN_NONE;
    Py_INCREF(c);
    PyObject *out = NULL;
    int stable = 0;
    if (!m->lost) {
        char *b = ((Region *)c->seg_o)->base;
        __atomic_thread_fence(ACQUIRE);                                            /* R4 */
        stable = __atomic_load_n((uint64_t *)(b + c->off[m->slot]), RELAXED) == m->gen;
    }
    if (!stable && msg_check(m) < 0)                   /* LeaseLost, counted there */
        goto done;
    m->released = 1;
    Py_XSETREF(m->array, Py_NewRef(Py_None));
    PyObject *d = c->rdict, *drop = dget(d, S_drop_lease);
    Region *lr = (Region *)c->lease_o;
    Py_ssize_t off = lease_offset(lr, m->lease);
    PyObject *free = dget(d, S_free_leases);
    if (drop != NULL || off < 0 || lr->base == NULL || !in_bounds(lr, off, LEASE_STRIDE)
            || free == NULL || !PyList_CheckExact(free)) {
        /* A replaced _drop_lease (tests), or anything unusual: the reader's method. */
        out = PyObject_CallMethod(c->reader, "_drop_lease", "n", m->lease);
        goto done;
    }
    __atomic_store_n((uint64_t *)(lr->base + off + 8), 0, RELEASE);               /* L4 */
    PyObject *ko = PyLong_FromSsize_t(m->lease);
    if (ko == NULL || PyList_Append(free, ko) < 0) {
        Py_XDECREF(ko);
        goto done;
    }
    Py_DECREF(ko);
    out = Py_NewRef(Py_None);
done:
    Py_DECREF(c);
    return out;
}

static PyObject *msg_enter(Msg *m, PyObject *unused) {
    return Py_NewRef((PyObject *)m);
}

/* Message.__exit__: release; with the body's own exception on its way, a LeaseLost from
 * the release is dropped (the body's is the one to report), as the Python one. */
static PyObject *msg_exit(Msg *m, PyObject *const *a, Py_ssize_t n) {
    PyObject *r = PyObject_CallMethodNoArgs((PyObject *)m, S_release);
    if (r != NULL) {
        Py_DECREF(r);
        Py_RETURN_NONE;
    }
    if (n < 1 || a[0] == Py_None)
        return NULL;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *errors = PyImport_ImportModule("supervisor.ipc.errors");
    PyObject *lost = errors ? PyObject_GetAttrString(errors, "LeaseLost") : NULL;
    Py_XDECREF(errors);
    if (lost == NULL) {                      /* cannot tell: the release's error stands */
        PyErr_Clear();
        PyErr_Restore(et, ev, tb);
        return NULL;
    }
    int match = PyErr_GivenExceptionMatches(et, lost);
    Py_DECREF(lost);
    if (!match) {
        PyErr_Restore(et, ev, tb);
        return NULL;
    }
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
    Py_RETURN_NONE;
}

static PyMemberDef msg_members[] = {
    {"_reader", T_OBJECT_EX, offsetof(Msg, reader), 0, NULL},
    {"_core", T_OBJECT_EX, offsetof(Msg, core), 0, NULL},
    {"_layout", T_OBJECT_EX, offsetof(Msg, layout), 0, NULL},
    {"stamp", T_OBJECT_EX, offsetof(Msg, stamp), 0, NULL},
    {"_array", T_OBJECT_EX, offsetof(Msg, array), 0, NULL},
    {"_raw_header", T_OBJECT_EX, offsetof(Msg, raw_header), 0, NULL},
    {"_receipt", T_OBJECT_EX, offsetof(Msg, receipt), 0, NULL},
    {"_slot", T_PYSSIZET, offsetof(Msg, slot), 0, NULL},
    {"_lease", T_PYSSIZET, offsetof(Msg, lease), 0, NULL},
    {"_gen", T_ULONGLONG, offsetof(Msg, gen), 0, NULL},
    {"_released", T_BOOL, offsetof(Msg, released), 0, NULL},
    {"_lost", T_BOOL, offsetof(Msg, lost), 0, NULL},
    {NULL}
};

static PyGetSetDef msg_getset[] = {
    {"array", (getter)msg_array, NULL,
     "Read-only zero-copy view with the published shape, dtype and strides.", NULL},
    {NULL}
};

static PyMethodDef msg_methods[] = {
    {"release", (PyCFunction)msg_release, METH_NOARGS,
     "Give the lease back; raises LeaseLost if the data changed while held."},
    {"__enter__", (PyCFunction)msg_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))msg_exit, METH_FASTCALL, NULL},
    {NULL}
};

static PyTypeObject MsgType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "supervisor.ipc._native.MessageBase",
    .tp_basicsize = sizeof(Msg),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A received message's storage, array and release (see _message.Message)",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)msg_dealloc,
    .tp_finalize = (destructor)msg_finalize,
    .tp_traverse = (traverseproc)msg_traverse,
    .tp_clear = (inquiry)msg_clear,
    .tp_members = msg_members,
    .tp_getset = msg_getset,
    .tp_methods = msg_methods,
};

/* ------------------------------------------------------------- the writer's Loan */

/* LoanBase: a Loan's storage (supervisor.ipc._loan.Loan derives from it), made in C
 * (`Loan(writer, slot)`), with `__enter__`, `__exit__` and the cache hit of `array` in
 * C: a stream's repeat description on the native path, found in the slot's cache
 * (writer._array_views[slot][(shape, dtype, strides, offset)] = (desc, lkey, span,
 * array), filled only by Loan._py_array, which checked it). Anything else is
 * `_py_array`'s (keywords, a frame, a miss, an unhashable shape). No memory is read
 * here: the array is numpy's view of the writer's own payload view. */

static PyObject *S_w_native, *S_array_views, *S_payloads, *S_py_array_l, *S_discard;

/* Every field an object member (T_OBJECT_EX, never NULL once made): the interpreter
 * specialises attribute access to those (Loan.publish reads five per call). */
typedef struct {
    PyObject_HEAD
    PyObject *w, *payload, *desc, *frame, *lkey, *span, *slot, *done;
} LoanObj;

static int loan_traverse(LoanObj *l, visitproc visit, void *arg) {
    Py_VISIT(l->w); Py_VISIT(l->payload); Py_VISIT(l->desc); Py_VISIT(l->frame);
    Py_VISIT(l->lkey); Py_VISIT(l->span); Py_VISIT(l->slot); Py_VISIT(l->done);
    return 0;
}

static int loan_clear(LoanObj *l) {
    Py_CLEAR(l->w); Py_CLEAR(l->payload); Py_CLEAR(l->desc); Py_CLEAR(l->frame);
    Py_CLEAR(l->lkey); Py_CLEAR(l->span); Py_CLEAR(l->slot); Py_CLEAR(l->done);
    return 0;
}

static void loan_dealloc(LoanObj *l) {
    PyObject_GC_UnTrack(l);
    loan_clear(l);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

/* Loan(writer, slot): Loan.__init__ as it was in Python. */
static int loan_init(LoanObj *l, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"writer", "slot", NULL};
    PyObject *w, *slot_o;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO:Loan", kwlist, &w, &slot_o))
        return -1;
    PyObject *payloads = PyObject_GetAttr(w, S_payloads);
    PyObject *payload = payloads ? PyObject_GetItem(payloads, slot_o) : NULL;
    Py_XDECREF(payloads);
    if (payload == NULL)
        return -1;
    Py_XSETREF(l->w, Py_NewRef(w));
    Py_XSETREF(l->payload, payload);
    Py_XSETREF(l->desc, Py_NewRef(Py_None));
    Py_XSETREF(l->frame, Py_NewRef(Py_None));
    Py_XSETREF(l->lkey, Py_NewRef(Py_None));    /* what the SlotLayout is encoded from */
    Py_XSETREF(l->span, Py_NewRef(Py_None));    /* tensor_span of desc (the CRC's bytes) */
    Py_XSETREF(l->slot, Py_NewRef(slot_o));
    Py_XSETREF(l->done, Py_NewRef(Py_False));
    return 0;
}

static PyObject *loan_enter(LoanObj *l, PyObject *unused) {
    return Py_NewRef((PyObject *)l);
}

/* An unpublished loan (or an exception) returns the slot, as Loan.__exit__ did. */
static PyObject *loan_exit(LoanObj *l, PyObject *const *a, Py_ssize_t n) {
    int done = l->done == NULL ? 0 : PyObject_IsTrue(l->done);
    if (done < 0)
        return NULL;
    if (!done) {
        PyObject *r = PyObject_CallMethodNoArgs((PyObject *)l, S_discard);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

static PyObject *loan_py_array(LoanObj *l, PyObject *const *a, size_t nargsf, PyObject *kwn) {
    PyObject *m = PyObject_GetAttr((PyObject *)l, S_py_array_l);
    if (m == NULL)
        return NULL;
    PyObject *r = PyObject_Vectorcall(m, a, nargsf, kwn);
    Py_DECREF(m);
    return r;
}

/* Loan.array(shape, dtype=None, strides=None, offset=0) */
static PyObject *loan_array(LoanObj *l, PyObject *const *a, Py_ssize_t nargs, PyObject *kwn) {
    if (kwn != NULL || nargs < 1 || nargs > 4 || l->w == NULL || l->slot == NULL
            || l->frame != Py_None || !PyLong_CheckExact(l->slot))
        return loan_py_array(l, a, nargs, kwn);
    Py_ssize_t slot = PyLong_AsSsize_t(l->slot);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    PyObject *wd = PyObject_GenericGetDict(l->w, NULL);
    if (wd == NULL)
        return NULL;
    PyObject *out = NULL, *key = NULL;
    PyObject *nat = PyDict_GetItemWithError(wd, S_w_native);
    PyObject *views = PyDict_GetItemWithError(wd, S_array_views);
    if (nat == NULL || nat == Py_None || views == NULL || !PyList_CheckExact(views)
            || slot < 0 || slot >= PyList_GET_SIZE(views))
        goto python;
    PyObject *per = PyList_GET_ITEM(views, slot);
    if (!PyDict_CheckExact(per))
        goto python;
    key = PyTuple_Pack(4, a[0], nargs > 1 ? a[1] : Py_None, nargs > 2 ? a[2] : Py_None,
                       nargs > 3 ? a[3] : S_zero);
    if (key == NULL)
        goto done;
    PyObject *kept = PyDict_GetItemWithError(per, key);     /* borrowed */
    if (kept == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError) && PyErr_Occurred())
            goto done;
        PyErr_Clear();                  /* a miss, or unhashable: Python decides */
        goto python;
    }
    if (!PyTuple_CheckExact(kept) || PyTuple_GET_SIZE(kept) != 4)
        goto python;
    Py_INCREF(kept);
    out = PyObject_CallMethodNoArgs(PyTuple_GET_ITEM(kept, 3), S_view);
    if (out != NULL) {
        Py_XSETREF(l->desc, Py_NewRef(PyTuple_GET_ITEM(kept, 0)));
        Py_XSETREF(l->lkey, Py_NewRef(PyTuple_GET_ITEM(kept, 1)));
        Py_XSETREF(l->span, Py_NewRef(PyTuple_GET_ITEM(kept, 2)));
    }
    Py_DECREF(kept);
    goto done;
python:
    out = loan_py_array(l, a, nargs, kwn);
done:
    Py_XDECREF(key);
    Py_DECREF(wd);
    return out;
}

/* Loan.publish(*, frame_id, capture_ts_ns, exposure_us, gain, publish_ts_ns, receipt):
 * the Python method's fast path, step for step (a stream's repeat publish: the
 * description the writer published last, by identity, no receipt, the same frame-ness,
 * not done): the writer's `_nhot` (publish_hot, or what a test put there) called with
 * the same 9 arguments; its False (a value outside its field) and every other case go
 * to the Python paths (`writer._publish`, `_py_publish`), an exception to
 * `writer._hot_failed` first, as there. */
static PyObject *S_frame_id, *S_capture_ts_ns, *S_exposure_us, *S_gain, *S_publish_ts_ns,
    *S_receipt, *S_fast, *S_nhot, *S_hot, *S_last_seq_w, *S_published, *S_hot_failed,
    *S_publish_w, *S_py_publish;

static PyObject *loan_publish(LoanObj *l, PyObject *const *a, Py_ssize_t nargs, PyObject *kwn) {
    /* frame_id, capture_ts_ns, exposure_us, gain, publish_ts_ns, receipt */
    PyObject *kv[6] = {Py_None, Py_None, Py_None, Py_None, Py_None, Py_None};
    PyObject *names[6] = {S_frame_id, S_capture_ts_ns, S_exposure_us, S_gain,
                          S_publish_ts_ns, S_receipt};
    int plain = nargs == 0 && l->w != NULL && l->done == Py_False && l->slot != NULL;
    Py_ssize_t nk = kwn == NULL ? 0 : PyTuple_GET_SIZE(kwn);
    for (Py_ssize_t i = 0; plain && i < nk; i++) {
        PyObject *k = PyTuple_GET_ITEM(kwn, i);
        int j = 0;
        while (j < 6 && k != names[j])
            j++;                        /* interned: the call's names are the same objects */
        if (j == 6)
            plain = 0;
        else
            kv[j] = a[nargs + i];
    }
    if (!plain || kv[5] != Py_None)
        goto python;
    PyObject *wd = PyObject_GenericGetDict(l->w, NULL);
    if (wd == NULL)
        return NULL;
    PyObject *fast = PyDict_GetItemWithError(wd, S_fast);
    if (fast == NULL || !PyTuple_CheckExact(fast) || PyTuple_GET_SIZE(fast) < 5
            || PyTuple_GET_ITEM(fast, 0) != l->lkey
            || PyTuple_GET_ITEM(fast, 1) != ((kv[0] == Py_None) ? Py_True : Py_False)) {
        Py_DECREF(wd);
        if (PyErr_Occurred())
            return NULL;
        goto python;
    }
    Py_INCREF(fast);
    PyObject *out = NULL, *seq = NULL, *nhot = NULL, *hot = NULL, *ts = NULL;
    Py_XSETREF(l->done, Py_NewRef(Py_True));
    PyObject *last = PyDict_GetItemWithError(wd, S_last_seq_w);
    nhot = Py_XNewRef(PyDict_GetItemWithError(wd, S_nhot));
    hot = Py_XNewRef(PyDict_GetItemWithError(wd, S_hot));
    if (last == NULL || nhot == NULL || hot == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "writer state missing");
        goto done;
    }
    seq = PyNumber_Add(last, S_one);
    if (seq == NULL)
        goto done;
    PyObject *args[9] = {hot, PyTuple_GET_ITEM(fast, 4), l->slot, seq, kv[4], kv[0], kv[1],
                         kv[2], kv[3]};
    ts = PyObject_Vectorcall(nhot, args, 9, NULL);
    if (ts != NULL && ts != Py_False) {
        PyObject *pub = PyDict_GetItemWithError(wd, S_published);
        if (pub == NULL && !PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "writer state missing");
        PyObject *np = pub ? PyNumber_Add(pub, S_one) : NULL;
        if (np != NULL && PyDict_SetItem(wd, S_last_seq_w, seq) == 0
                && PyDict_SetItem(wd, S_published, np) == 0)
            out = Py_NewRef(seq);
        Py_XDECREF(np);
    } else if (ts == Py_False) {
        out = PyObject_CallMethodObjArgs(l->w, S_publish_w, (PyObject *)l, kv[0], kv[1],
                                         kv[2], kv[3], kv[4], kv[5], NULL);
        goto done;
    }
    if (out == NULL) {
        /* Went out or not: Writer._hot_failed decides (counted; else the slot goes back). */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *r = PyObject_CallMethodObjArgs(l->w, S_hot_failed, (PyObject *)l, seq, NULL);
        if (r == NULL) {
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(tb);
        } else {
            Py_DECREF(r);
            PyErr_Restore(et, ev, tb);
        }
    }
done:
    Py_XDECREF(ts);
    Py_XDECREF(seq);
    Py_XDECREF(nhot);
    Py_XDECREF(hot);
    Py_DECREF(fast);
    Py_DECREF(wd);
    return out;
python:
    {
        PyObject *m = PyObject_GetAttr((PyObject *)l, S_py_publish);
        if (m == NULL)
            return NULL;
        PyObject *r = PyObject_Vectorcall(m, a, nargs, kwn);
        Py_DECREF(m);
        return r;
    }
}

static PyMemberDef loan_members[] = {
    {"_w", T_OBJECT_EX, offsetof(LoanObj, w), 0, NULL},
    {"_payload", T_OBJECT_EX, offsetof(LoanObj, payload), 0, NULL},
    {"_desc", T_OBJECT_EX, offsetof(LoanObj, desc), 0, NULL},
    {"_frame", T_OBJECT_EX, offsetof(LoanObj, frame), 0, NULL},
    {"_lkey", T_OBJECT_EX, offsetof(LoanObj, lkey), 0, NULL},
    {"_span", T_OBJECT_EX, offsetof(LoanObj, span), 0, NULL},
    {"slot", T_OBJECT_EX, offsetof(LoanObj, slot), 0, NULL},
    {"_done", T_OBJECT_EX, offsetof(LoanObj, done), 0, NULL},
    {NULL}
};

static PyMethodDef loan_methods[] = {
    {"array", (PyCFunction)(void (*)(void))loan_array, METH_FASTCALL | METH_KEYWORDS,
     "A writable view that becomes the published tensor (C-contiguous by default)."},
    {"publish", (PyCFunction)(void (*)(void))loan_publish, METH_FASTCALL | METH_KEYWORDS,
     "Make the slot visible to readers and wake them. Returns the sequence number."},
    {"__enter__", (PyCFunction)loan_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))loan_exit, METH_FASTCALL, NULL},
    {NULL}
};

static PyTypeObject LoanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "supervisor.ipc._native.LoanBase",
    .tp_basicsize = sizeof(LoanObj),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A loan's storage, __enter__/__exit__ and array's cache hit (see _loan.Loan)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)loan_init,
    .tp_dealloc = (destructor)loan_dealloc,
    .tp_traverse = (traverseproc)loan_traverse,
    .tp_clear = (inquiry)loan_clear,
    .tp_members = loan_members,
    .tp_methods = loan_methods,
};

/* ------------------------------------------------------------- module */

static PyMethodDef module_methods[] = {
    {"fence_acquire", fence_acquire, METH_NOARGS, "atomic_thread_fence(acquire)"},
    {"fence_release", fence_release, METH_NOARGS, "atomic_thread_fence(release)"},
    {"fence_full", fence_full, METH_NOARGS, "atomic_thread_fence(seq_cst)"},
    {"loan", (PyCFunction)(void (*)(void))w_loan, METH_FASTCALL,
     "the writer's slot choice; makes the slot's generation odd"},
    {"publish", (PyCFunction)(void (*)(void))w_publish, METH_FASTCALL,
     "the writer's publish: control block, stamp, generation, last_seq, wake-ups"},
    {"take", (PyCFunction)(void (*)(void))r_take, METH_FASTCALL,
     "the reader's seqlock read of the next slot, with its lease"},
    {"publish_hot", (PyCFunction)(void (*)(void))w_publish_hot, METH_FASTCALL,
     "a stream's repeat publish in one call: header plan, layout, publish, wake-ups"},
    {"pack_header", (PyCFunction)(void (*)(void))h_pack, METH_FASTCALL,
     "a compiled SlotHeader plan written into the segment (False: let Python raise)"},
    {"receipt", (PyCFunction)(void (*)(void))h_receipt, METH_FASTCALL,
     "the Receipt in a SlotHeader, None, or the slow sentinel (pycapnp decides)"},
    {"accept", (PyCFunction)(void (*)(void))h_accept, METH_FASTCALL,
     "the reader's checks of a plain SlotHeader: a Stamp, or None (Python decides)"},
    {NULL}
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "supervisor.ipc._native",
    "Acquire/release atomics and the bridge's per-message hot path (see _native.c).",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the bridge's wire format (capnp, the control blocks) is little-endian"
#endif
    if (PyType_Ready(&RegionType) < 0 || PyType_Ready(&CoreType) < 0
            || PyType_Ready(&MsgType) < 0 || PyType_Ready(&LoanType) < 0)
        return NULL;
#define INTERN(v, s) if ((v = PyUnicode_InternFromString(s)) == NULL) return NULL
    INTERN(S_ntake, "_ntake"); INTERN(S_naccept, "_naccept"); INTERN(S_cadence, "_cadence");
    INTERN(S_burst, "_burst"); INTERN(S_last_seq, "_last_seq");
    INTERN(S_free_leases, "_free_leases"); INTERN(S_last_capture, "_last_capture");
    INTERN(S_last_take, "_last_take"); INTERN(S_last_layout, "_last_layout");
    INTERN(S_received, "_received"); INTERN(S_rejected, "_rejected");
    INTERN(S_dropped, "_dropped"); INTERN(S_pos, "_pos"); INTERN(S_delivered, "_delivered");
    INTERN(S_views, "_views"); INTERN(S_drop_lease, "_drop_lease"); INTERN(S_check, "check");
    INTERN(S_kept_array, "_kept_array"); INTERN(S_view, "view");
    INTERN(S_py_array, "_py_array"); INTERN(S_py_release, "_py_release");
    INTERN(S_release, "release"); INTERN(S_took_m, "took");
    INTERN(S_w_native, "_native"); INTERN(S_array_views, "_array_views");
    INTERN(S_payloads, "_payloads"); INTERN(S_py_array_l, "_py_array");
    INTERN(S_discard, "discard");
    INTERN(S_frame_id, "frame_id"); INTERN(S_capture_ts_ns, "capture_ts_ns");
    INTERN(S_exposure_us, "exposure_us"); INTERN(S_gain, "gain");
    INTERN(S_publish_ts_ns, "publish_ts_ns"); INTERN(S_receipt, "receipt");
    INTERN(S_fast, "_fast"); INTERN(S_nhot, "_nhot"); INTERN(S_hot, "_hot");
    INTERN(S_last_seq_w, "_last_seq"); INTERN(S_published, "_published");
    INTERN(S_hot_failed, "_hot_failed"); INTERN(S_publish_w, "_publish");
    INTERN(S_py_publish, "_py_publish");
    if ((S_one = PyLong_FromLong(1)) == NULL || (S_zero = PyLong_FromLong(0)) == NULL)
        return NULL;
#undef INTERN
    PyObject *mod = PyModule_Create(&moduledef);
    if (mod == NULL)
        return NULL;
    Py_INCREF(&RegionType);
    if (PyModule_AddObject(mod, "Region", (PyObject *)&RegionType) < 0) {
        Py_DECREF(&RegionType);
        Py_DECREF(mod);
        return NULL;
    }
    Py_INCREF(&CoreType);
    Py_INCREF(&MsgType);
    Py_INCREF(&LoanType);
    if (PyModule_AddObject(mod, "ReaderCore", (PyObject *)&CoreType) < 0
            || PyModule_AddObject(mod, "MessageBase", (PyObject *)&MsgType) < 0
            || PyModule_AddObject(mod, "LoanBase", (PyObject *)&LoanType) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    PyModule_AddIntConstant(mod, "MAX_SLOTS", MAX_SLOTS);
    PyModule_AddIntConstant(mod, "AWAKE_OFF", AWAKE_OFF);
    PyModule_AddIntConstant(mod, "READER_AWAKE", READER_AWAKE);
    PyModule_AddIntConstant(mod, "SLEEPS_OFF", SLEEPS_OFF);
    PyModule_AddIntConstant(mod, "TAKEN_OFF", TAKEN_OFF);
    return mod;
}
