# The privileged broker's vocabulary (supervisor/broker, docs/broker.md): the only
# messages the supervisor proper may send to the process that holds root. One message
# per SOCK_SEQPACKET datagram; fds travel beside it with SCM_RIGHTS, in the order each
# request or reply names. Nothing here carries an argv, a uid, a bind or a path: the
# broker builds every launch from the config it loaded itself at start.
@0xbccbd2aa7bb29a5a;

enum Signal {
  term @0;
  kill @1;
  int @2;
  hup @3;
  usr1 @4;
  usr2 @5;
}

# The /proc files the exec watch, the maps scan and the audit read (opened by the broker,
# so the kernel's access check at open is the broker's; read by the supervisor proper).
enum ProcFile {
  status @0;
  stat @1;
  maps @2;
  mountinfo @3;
  cgroup @4;
  mem @5;         # read-only: the exec watch reads a syscall's path argument
  pagemap @6;     # the exec watch and the maps scan: code pages no file holds
}

enum ChannelRole {
  writer @0;
  reader @1;
}

# One channel the worker of a start request is handed: the fds of its handle, in the
# order WriterHandle.fds() / ReaderHandle.fds() give them.
struct ChannelGrant {
  channel @0 :Text;
  role @1 :ChannelRole;
  fdCount @2 :UInt16;
}

# One incarnation of a worker (a run or a standby): the name of what the broker started.
struct Sandbox {
  worker @0 :Text;
  incarnation @1 :UInt32;
}

struct Start {
  worker @0 :Text;
  incarnation @1 :UInt32;     # never reused for a worker
  standby @2 :Bool;           # no channels; a control socket instead
  channels @3 :List(ChannelGrant);
}

# A warm standby's hand-over (red team 10 row 9): the channels of `start`, checked as a
# start's are, sent to the standby by the broker over the control socket it kept (the
# supervisor proper never holds it). Once per standby; `ok`.
struct Adopt {
  worker @0 :Text;
  incarnation @1 :UInt32;     # a standby the broker started and has not handed over
  channels @2 :List(ChannelGrant);
}

struct SignalPid {
  pid @0 :Int32;
  signal @1 :Signal;
}

struct OpenProc {
  pid @0 :Int32;
  files @1 :List(ProcFile);
}

# One open file of a sandboxed process (/proc/PID/fd/N). The broker formats the name
# from the numbers: no path travels. Handed back as an O_PATH fd of the target.
struct OpenFd {
  pid @0 :Int32;
  fd @1 :Int32;               # 0 .. 2^20-1 (fs.nr_open's ceiling)
}

# One mapped object (/proc/PID/map_files/START-END, CAP_SYS_ADMIN): an O_PATH fd of it.
struct OpenMapFile {
  pid @0 :Int32;
  start @1 :UInt64;           # page-aligned, start < end
  end @2 :UInt64;
}

# Many mapped objects of one process at once (the maps scan identifies every executable
# mapping each second: one request per scan, not one per mapping).
struct MapRange {
  start @0 :UInt64;           # page-aligned, start < end
  end @1 :UInt64;
}

struct OpenMapFiles {
  pid @0 :Int32;
  ranges @1 :List(MapRange);  # 1..64 (the fds of one reply)
}

# SIGSTOP or SIGCONT to one thread (tgkill) of a process of the broker's sandboxes: the
# exec watch stops the worker while it judges one of its requests.
struct SignalThread {
  pid @0 :Int32;              # the thread group
  tid @1 :Int32;              # one of its threads (checked in /proc/PID/task)
  stop @2 :Bool;              # true: SIGSTOP, false: SIGCONT
}

struct Request {
  id @0 :UInt32;              # echoed in the reply
  union {
    ping @1 :Void;
    start @2 :Start;          # fds: every grant's fds, in grant order
    signal @3 :SignalPid;
    killSandbox @4 :Sandbox;  # SIGKILL to its bwrap and everything in its cgroup
    reap @5 :Sandbox;
    pids @6 :Sandbox;         # host pids of the sandbox's processes
    openProc @7 :OpenProc;
    setLatch @8 :Text;        # the reason; the broker writes state_dir/failsafe.latch
    clearLatch @9 :Void;
    readLatch @10 :Void;
    realtime @11 :Sandbox;    # SCHED_FIFO at the worker's configured priority
    openFd @12 :OpenFd;
    openMapFile @13 :OpenMapFile;
    signalThread @14 :SignalThread;
    openPidNs @15 :Int32;     # the pid: an O_PATH fd of its /proc/PID/ns/pid (the exec
                              # watch asks whether a worker's parent is its sandbox's init)
    readFilters @16 :Int32;   # the pid: every thread seized, its seccomp programs read
                              # back (PTRACE_SECCOMP_GET_FILTER) and matched against the
                              # W^X program only (sandbox/wx.py), let go: `filters`
    openMapFiles @17 :OpenMapFiles;   # `links`
    reserveLatch @18 :Void;   # make state_dir/failsafe.latch.reserve if it is not whole
    adopt @19 :Adopt;         # fds: every grant's fds, in grant order
  }
}

enum ErrorCode {
  malformed @0;      # not a message of this schema
  tooLarge @1;       # over the broker's message size
  badFds @2;         # fds where none belong, too many, or of the wrong kind
  unknownWorker @3;  # not a worker of the broker's config
  notOurs @4;        # a pid or incarnation the broker did not start
  refused @5;        # against the broker's config (uid 0, a bind, the state dir...)
  failed @6;         # allowed, but the kernel or bwrap said no
}

struct Error {
  code @0 :ErrorCode;
  reason @1 :Text;
  errno @2 :Int32;            # failed: the kernel's errno (0: none), so a /proc reader
}                             # through the broker sees ENOENT/ESRCH as it would directly

struct Started {
  pid @0 :Int32;              # the outer bwrap (host pid)
  hostUid @1 :Int32;          # -1: the broker's own (not root)
  cgroup @2 :Bool;
  execWatch @3 :Bool;         # fds: pidfd, status read end, output read end,
                              #      [exec-watch socket]
  control @4 :Bool;           # a standby: the broker holds its control socket (`adopt`);
}                             # no fd of it travels

struct Reaped {
  exited @0 :Bool;
  code @1 :Int32;             # Popen.returncode
  oomKills @2 :UInt32;
}

# What readFilters found: the exact W^X program on every thread (ptrace true), or that the
# broker could not read filters back here (ptrace false: the caller counts instead).
struct Filters {
  ptrace @0 :Bool;
  ok @1 :Bool;
  reason @2 :Text;            # why not, naming the thread
  threads @3 :UInt32;
  micros @4 :UInt32;          # the check's wall time in the broker
}

struct Reply {
  id @0 :UInt32;
  union {
    ok @1 :Void;
    started @2 :Started;
    reaped @3 :Reaped;
    pids @4 :List(Int32);
    opened @5 :List(ProcFile);   # fds: the /proc/PID directory, then one per file
    latch @6 :Text;              # "" when not latched
    error @7 :Error;
    link @8 :Void;               # fds: one O_PATH fd (openFd, openMapFile, openPidNs)
    filters @9 :Filters;         # readFilters
    links @10 :List(Bool);       # openMapFiles: per range, whether it is mapped; fds:
  }                              # one O_PATH fd per true, in order
}
