/* The fork of a worker from a worker template inside a namespace sandbox, in C.
 *
 * `agent_sandbox/_worker/nstemplate.py` (its module docstring, step 1) describes what a
 * namespace template does for each worker: P, PID 1 of a new PID namespace, sends one byte
 * on the request's credential socket, enters new mount, network and IPC namespaces and
 * forks the worker W; P then drops every capability, sets no-new-privileges, closes every
 * descriptor but 0-2 and execs the small init (agent_sandbox/_worker/_nsinit.c). Done in Python, P's life
 * cost about 2.3 ms of CPU and 440 copy-on-write faults per worker (the interpreter writes
 * its objects' reference counts as it runs), the largest part of what a namespace worker
 * costs more than a plain template's (issue 19: 20 sessions at once).
 *
 * `fork_worker(log_fd, cred_fd, init)` does it with system calls only:
 *
 * - clone3(2) (or clone(2)) with CLONE_NEWPID, as fork(2) otherwise: P is the template's
 *   own child and PID 1 of a new PID namespace (no helper process, no reparenting). P runs
 *   no Python of its own: only the interpreter's before-fork hooks, which `PyOS_BeforeFork`
 *   runs as `os.fork` does. The C library's record of P's thread keeps the template's
 *   thread id, which only matters to a thread signalling itself through that record, and
 *   nothing here does.
 * - Only for a single-threaded template (`nstemplate.fork` checks the kernel's count): P
 *   would wait forever for a lock another thread held at the clone (the before-fork hooks'
 *   and the C library's fork take some); the helper's path serves instead.
 * - In P, in this order: its parent-death signal (SIGKILL: it dies with the template), a
 *   session of its own, the log as stdout and stderr, the byte on the credential socket
 *   (the host reads P's pid from the kernel's credentials and places P and W in the worker's
 *   cgroups), the new namespaces, then W is forked between `PyOS_BeforeFork` and
 *   `PyOS_AfterFork_Child`, as `os.fork` does. A failed step writes
 *   "agent-sandbox worker set-up failed: <step>: <error>" to the log and ends P with status 70
 *   (and W with it, as the Python path does).
 * - W returns ("worker", 0) to Python, which builds W's view and sets it up (`build_view`).
 * - P execs `init` with W's pid, by a descriptor it opened before W's fork (W's fresh `/tmp`
 *   can hide the path for a moment); where `init` is empty or the exec fails, P returns
 *   ("init", W's pid) and the Python loop of `nstemplate.init_loop` serves instead.
 * - The template gets ("template", P's pid); OSError when the clone fails (ENOSYS where
 *   neither system call can be made here: the template then uses its helper).
 *
 * Linux only; optional like the other extensions: without it the template forks P through
 * a short-lived helper and P does the same steps in Python. */

#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Bumped when the behaviour changes, so a stale build is noticed (`nstemplate._load_nsfork`). */
#define NSFORK_VERSION 4

/* The kernel's `struct clone_args`, its first version (64 bytes): defined here because
 * <linux/sched.h>, which has it, clashes with the C library's <sched.h>. */
struct nsfork_clone_args {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls;
};

/* fork(2) into a new PID namespace: clone3(2) where the kernel has it (its arguments are
 * the same on every architecture), otherwise (ENOSYS, or EPERM from a container's seccomp
 * profile that refuses clone3 alone) clone(2) on the architectures whose argument order is
 * flags first (every other argument is 0 here, so only that order matters); -1 with ENOSYS
 * elsewhere, and the template falls back to its helper. */
static long clone_newpid(void) {
#ifdef SYS_clone3
    struct nsfork_clone_args args;
    memset(&args, 0, sizeof args);
    args.flags = CLONE_NEWPID;
    args.exit_signal = SIGCHLD;
    long pid = syscall(SYS_clone3, &args, sizeof args);
    if (pid >= 0 || (errno != ENOSYS && errno != EPERM)) {
        return pid;
    }
#endif
#if defined(__x86_64__) || defined(__aarch64__) || defined(__i386__) || defined(__arm__) \
    || defined(__riscv) || defined(__powerpc__) || defined(__loongarch__)
    return syscall(SYS_clone, (unsigned long)(CLONE_NEWPID | SIGCHLD), 0L, 0L, 0L, 0L);
#else
    errno = ENOSYS;
    return -1;
#endif
}

/* In P: name the failed step in the log and end P. */
static void fail(const char *step) {
    char line[256];
    int err = errno;
    int n = snprintf(line, sizeof line, "agent-sandbox worker set-up failed: %s: %s\n", step,
                     strerror(err));
    if (n > 0) {
        ssize_t ignored = write(2, line, (size_t)(n < (int)sizeof line ? n : (int)sizeof line - 1));
        (void)ignored;
    }
    _exit(70);
}

/* Close every descriptor from `low` to `high` (inclusive). */
static void close_between(unsigned int low, unsigned int high) {
    if (low > high) {
        return;
    }
#ifdef SYS_close_range
    if (syscall(SYS_close_range, low, high, 0U) == 0) {
        return;
    }
#endif
    for (unsigned int fd = low; fd <= high && fd < (1U << 16); fd++) {
        (void)close((int)fd);
    }
}

/* P, once W is forked: no capability, no new privileges, no descriptor but 0-2 and
 * `init_fd` (close-on-exec), then the init, by that descriptor: W shares P's new mount
 * namespace and builds its view in it, and its fresh `/tmp` can hide the init's path for a
 * moment (a checkout under /tmp) before its mounts there are carried back. Returns only
 * when the init cannot run. */
static void exec_init(const char *init, int init_fd, pid_t worker) {
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &header, data) != 0) {
        fail("capset");
    }
    if (init_fd < 0) {
        return;
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
        fail("no new privileges");
    }
    close_between(3U, (unsigned int)init_fd - 1U);
    close_between((unsigned int)init_fd + 1U, ~0U);
    char pid_text[24];
    snprintf(pid_text, sizeof pid_text, "%ld", (long)worker);
    char *argv[] = {(char *)init, pid_text, NULL};
    char *envp[] = {NULL};
    fexecve(init_fd, argv, envp);
    (void)close(init_fd);
}

static PyObject *fork_worker(PyObject *self, PyObject *args) {
    int log_fd, cred_fd;
    const char *init;
    (void)self;
    if (!PyArg_ParseTuple(args, "iis:fork_worker", &log_fd, &cred_fd, &init)) {
        return NULL;
    }
    if (log_fd < 3 || cred_fd < 3 || log_fd == cred_fd) {
        PyErr_SetString(PyExc_ValueError, "fork_worker: the log and credential descriptors "
                                          "must be two descriptors above 2");
        return NULL;
    }
    long p = clone_newpid();
    if (p < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (p > 0) {
        return Py_BuildValue("(sl)", "template", p);
    }
    /* P: PID 1 of the new PID namespace. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) {
        fail("parent-death signal");
    }
    /* The init, opened before W exists (see `exec_init`); -1 (the Python loop) without it. */
    int init_fd = init[0] != '\0' ? open(init, O_RDONLY | O_CLOEXEC) : -1;
    if (setsid() < 0) {
        fail("setsid");
    }
    if (dup2(log_fd, 1) < 0 || dup2(log_fd, 2) < 0) {
        fail("log");
    }
    (void)close(log_fd);
    if (send(cred_fd, "p", 1, MSG_NOSIGNAL) != 1) {
        fail("credentials");
    }
    (void)close(cred_fd);
    if (unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC) != 0) {
        fail("unshare");
    }
    PyOS_BeforeFork();
    pid_t worker = fork();
    if (worker < 0) {
        fail("fork");
    }
    if (worker == 0) {
        if (init_fd >= 0) {
            (void)close(init_fd); /* P's, for its exec: nothing W keeps */
        }
        PyOS_AfterFork_Child();
        return Py_BuildValue("(si)", "worker", 0);
    }
    exec_init(init, init_fd, worker);
    PyOS_AfterFork_Parent();
    return Py_BuildValue("(sl)", "init", (long)worker);
}

static PyMethodDef methods[] = {
    {"fork_worker", fork_worker, METH_VARARGS,
     "fork_worker(log_fd, cred_fd, init) -> (role, pid): a namespace template's worker"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_nsfork", "A namespace template's fork of a worker, in C.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__nsfork(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    PyObject *all = Py_BuildValue("[ss]", "VERSION", "fork_worker");
    if (all == NULL || PyModule_AddIntConstant(m, "VERSION", NSFORK_VERSION) < 0
        || PyModule_AddObjectRef(m, "__all__", all) < 0) {
        Py_XDECREF(all);
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(all);
    return m;
}
