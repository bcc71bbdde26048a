/* The init (PID 1) of a worker forked from a worker template inside a namespace sandbox.
 *
 * `agent_sandbox/_worker/template.py` forks the init (P) from the Python template; P sets up
 * the worker's namespaces in Python, forks the worker (W), drops every capability, sets
 * no-new-privileges, closes every descriptor but 0-2 and then execs this program with W's
 * pid (`_nsinit <pid>`), so that P no longer holds a copy of the template's interpreter (its
 * pages, written after the fork, were private to it: about 1.7 MB each, 3 MB of PSS).
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
 * Plain C and libc only, no allocation; built as a (static when possible) executable by
 * setup.py next to the C extensions. Without it the Python loop stays. */

#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static void say(const char *text) {
    ssize_t ignored = write(2, text, strlen(text));
    (void)ignored;
}

static void on_sigint(int sig) {
    (void)sig;
    say("agent-sandbox worker init: interrupted (SIGINT)\n");
    _exit(70);
}

int main(int argc, char **argv) {
    char *end = NULL;
    long worker;
    struct sigaction action;

    if (argc != 2) {
        say("usage: _nsinit <worker pid>\n");
        return 64;
    }
    errno = 0;
    worker = strtol(argv[1], &end, 10);
    if (errno != 0 || end == argv[1] || *end != '\0' || worker <= 0 || worker > INT_MAX) {
        say("agent-sandbox worker init: not a pid\n");
        return 64;
    }
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) {
        say("agent-sandbox worker init: no parent-death signal\n");
        return 70;
    }
    memset(&action, 0, sizeof action);
    action.sa_handler = on_sigint;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGINT, &action, NULL) != 0) {
        return 70;
    }
    for (;;) {
        int status = 0;
        pid_t pid = waitpid(-1, &status, 0);
        if (pid < 0) {
            if (errno == EINTR) {
                continue;
            }
            say("agent-sandbox worker init: wait failed\n");
            _exit(70);
        }
        if (pid == (pid_t)worker) {
            if (WIFSIGNALED(status)) {
                _exit(128 + WTERMSIG(status));
            }
            _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 1);
        }
    }
}
