/* The init (PID 1) of a worker forked from a worker template inside a namespace sandbox.
 *
 * `agent_sandbox/_worker/nstemplate.py` forks the init (P) from the Python template; P enters
 * the worker's new namespaces, forks the worker (W, which builds its own view), drops every
 * capability, sets no-new-privileges, closes every descriptor but 0-2 and then execs this
 * program with W's pid (`_nsinit <pid>`), so that P no longer holds a copy of the template's
 * interpreter (its pages, written after the fork, were private to it: about 1.7 MB each,
 * 3 MB of PSS).
 *
 * It does exactly what P's Python loop did after forking W:
 *
 * - reaps every child (orphans of W's tree re-parent to it, PID 1 of the namespace) until W
 *   exits, then exits as W did: W's exit code, or 128 + N when a signal N ended it;
 * - dies with the template: its parent-death signal (SIGKILL), armed before the exec and
 *   kept by it (no credentials change), is armed again here;
 * - SIGINT ends it with status 70 and a line on stderr (the Python loop's KeyboardInterrupt
 *   did the same); the other signals keep their dispositions (SIG_DFL signals do not reach
 *   a namespace's init; the ignored ones stay ignored across exec);
 * - a wrong command line is status 64, a failed wait status 70.
 *
 * Plain C, no allocation. setup.py first builds it without the C library (NSINIT_NOLIBC:
 * the five system calls it makes and its entry point are below, for x86-64 and arm64), a
 * static executable of two pages: each init then maps about 10 kB instead of the static C
 * library's 650 kB (issue 19: memory per session). Where that build fails or its result
 * does not run, it is built against the C library (static when possible). Without any
 * build the Python loop stays. */

#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>

#ifdef NSINIT_NOLIBC

/* The system calls, made directly. Each returns the kernel's result: -errno on failure. */
#if defined(__x86_64__)
enum { NR_WRITE = 1, NR_RT_SIGACTION = 13, NR_RT_SIGRETURN = 15, NR_WAIT4 = 61,
       NR_PRCTL = 157, NR_EXIT_GROUP = 231 };

static long sys5(long n, long a, long b, long c, long d, long e) {
    long ret;
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8)
                     : "rcx", "r11", "memory");
    return ret;
}

/* The entry point: the kernel leaves argc, then argv, on the stack. */
__asm__(".text\n"
        ".global _start\n"
        "_start:\n"
        "    xor %rbp, %rbp\n"
        "    mov %rsp, %rdi\n"
        "    and $-16, %rsp\n"
        "    call nsinit_main\n"
        "    hlt\n");

/* Where a signal handler returns to (x86-64 has no default one): rt_sigreturn. */
void nsinit_restorer(void);
__asm__(".text\n"
        "nsinit_restorer:\n"
        "    mov $15, %rax\n"
        "    syscall\n"
        "    hlt\n");
#elif defined(__aarch64__)
enum { NR_WRITE = 64, NR_RT_SIGACTION = 134, NR_RT_SIGRETURN = 139, NR_WAIT4 = 260,
       NR_PRCTL = 167, NR_EXIT_GROUP = 94 };

static long sys5(long n, long a, long b, long c, long d, long e) {
    register long x8 __asm__("x8") = n;
    register long x0 __asm__("x0") = a;
    register long x1 __asm__("x1") = b;
    register long x2 __asm__("x2") = c;
    register long x3 __asm__("x3") = d;
    register long x4 __asm__("x4") = e;
    __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4) : "memory");
    return x0;
}

__asm__(".text\n"
        ".global _start\n"
        "_start:\n"
        "    mov x29, #0\n"
        "    mov x30, #0\n"
        "    mov x0, sp\n"
        "    bl nsinit_main\n"
        "    brk #0\n");

void nsinit_restorer(void);
__asm__(".text\n"
        "nsinit_restorer:\n"
        "    mov x8, #139\n"
        "    svc 0\n"
        "    brk #0\n");
#else
#error "NSINIT_NOLIBC: no system call layer for this architecture (the C library build serves)"
#endif

/* The kernel's struct sigaction (not the C library's). */
struct kernel_sigaction {
    void (*handler)(int);
    unsigned long flags;
    void (*restorer)(void);
    unsigned long mask;
};
#define NSINIT_SA_RESTORER 0x04000000UL

static __attribute__((noreturn)) void die(int code) {
    for (;;) {
        sys5(NR_EXIT_GROUP, code, 0, 0, 0, 0);
    }
}

static unsigned long text_length(const char *text) {
    unsigned long n = 0;
    while (text[n] != '\0') {
        n++;
    }
    return n;
}

static void say(const char *text) {
    sys5(NR_WRITE, 2, (long)text, (long)text_length(text), 0, 0);
}

static int set_pdeathsig(void) {
    return sys5(NR_PRCTL, PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) == 0 ? 0 : -1;
}

static void on_sigint(int sig);

static int catch_sigint(void) {
    struct kernel_sigaction action;
    action.handler = on_sigint;
    action.flags = NSINIT_SA_RESTORER;
    action.restorer = nsinit_restorer;
    action.mask = 0;
    return sys5(NR_RT_SIGACTION, SIGINT, (long)&action, 0, sizeof action.mask, 0) == 0 ? 0 : -1;
}

/* A child's pid, or -errno. */
static long reap(int *status) {
    return sys5(NR_WAIT4, -1, (long)status, 0, 0, 0);
}

/* The worker's pid from its decimal text: 0 when it is not one. */
static long parse_pid(const char *text) {
    long value = 0;
    if (*text == '\0') {
        return 0;
    }
    for (; *text != '\0'; text++) {
        if (*text < '0' || *text > '9' || value > INT_MAX / 10) {
            return 0;
        }
        value = value * 10 + (*text - '0');
    }
    return value <= INT_MAX ? value : 0;
}

#define NSINIT_EXIT(code) die(code)

#else /* the C library */

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void say(const char *text) {
    ssize_t ignored = write(2, text, strlen(text));
    (void)ignored;
}

static int set_pdeathsig(void) {
    return prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
}

static void on_sigint(int sig);

static int catch_sigint(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = on_sigint;
    sigemptyset(&action.sa_mask);
    return sigaction(SIGINT, &action, NULL);
}

static long reap(int *status) {
    pid_t pid = waitpid(-1, status, 0);
    return pid < 0 ? -errno : (long)pid;
}

static long parse_pid(const char *text) {
    char *end = NULL;
    long value;
    errno = 0;
    value = strtol(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || value <= 0 || value > INT_MAX) {
        return 0;
    }
    return value;
}

#define NSINIT_EXIT(code) _exit(code)

#endif

static void on_sigint(int sig) {
    (void)sig;
    say("agent-sandbox worker init: interrupted (SIGINT)\n");
    NSINIT_EXIT(70);
}

static int run(int argc, char **argv) {
    long worker;

    if (argc != 2) {
        say("usage: _nsinit <worker pid>\n");
        return 64;
    }
    worker = parse_pid(argv[1]);
    if (worker <= 0) {
        say("agent-sandbox worker init: not a pid\n");
        return 64;
    }
    if (set_pdeathsig() != 0) {
        say("agent-sandbox worker init: no parent-death signal\n");
        return 70;
    }
    if (catch_sigint() != 0) {
        return 70;
    }
    for (;;) {
        int status = 0;
        long pid = reap(&status);
        if (pid < 0) {
            if (pid == -EINTR) {
                continue;
            }
            say("agent-sandbox worker init: wait failed\n");
            return 70;
        }
        if (pid == worker) {
            if (WIFSIGNALED(status)) {
                return 128 + WTERMSIG(status);
            }
            return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
        }
    }
}

#ifdef NSINIT_NOLIBC
__attribute__((noreturn, used)) void nsinit_main(long *stack) {
    die(run((int)stack[0], (char **)(stack + 1)));
}
#else
int main(int argc, char **argv) {
    NSINIT_EXIT(run(argc, argv));
}
#endif
