/* Simulated nvidia-cuda-mps-control: the MPS control daemon and its command client.
 *
 *   nvidia-cuda-mps-control -d    start the daemon in the background (returns once it listens)
 *   nvidia-cuda-mps-control -f    run it in the foreground
 *   nvidia-cuda-mps-control       client: one command per stdin line, answers on stdout
 *
 * As the real one: the daemon is found through CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps),
 * writes nvidia-cuda-mps-control.pid there and logs to control.log in CUDA_MPS_LOG_DIRECTORY
 * (default /var/log/nvidia-mps). The "pipe" is a UNIX socket named `control` in the pipe directory,
 * so a container given the directory (a bind mount) talks to the host's daemon. Commands: the
 * default active thread percentage and per-device pinned memory limits (get/set), get_server_list
 * (no servers: no CUDA clients here) and quit. The limits live in the daemon only, as the real
 * ones do, so whoever asks through the pipe sees what the daemon was told. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define MAX_LIMITS 64

static char pipe_dir[2048], log_dir[2048], sock_path[2200], pid_path[2200], log_path[2200];
static double thread_pct = 100.0;
static struct { char dev[128], value[32]; } limits[MAX_LIMITS];
static int nlimits;

static void dirs(void) {
    const char *p = getenv("CUDA_MPS_PIPE_DIRECTORY"), *l = getenv("CUDA_MPS_LOG_DIRECTORY");
    snprintf(pipe_dir, sizeof pipe_dir, "%s", p && *p ? p : "/tmp/nvidia-mps");
    snprintf(log_dir, sizeof log_dir, "%s", l && *l ? l : "/var/log/nvidia-mps");
    snprintf(sock_path, sizeof sock_path, "%s/control", pipe_dir);
    snprintf(pid_path, sizeof pid_path, "%s/nvidia-cuda-mps-control.pid", pipe_dir);
    snprintf(log_path, sizeof log_path, "%s/control.log", log_dir);
}

static void logf_(const char *fmt, ...) {
    FILE *f = fopen(log_path, "a");
    if (!f) return;
    char when[64];
    time_t now = time(NULL);
    strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", localtime(&now));
    fprintf(f, "[%s] ", when);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
    fclose(f);
}

static int connect_daemon(void) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(sock_path) >= sizeof addr.sun_path) return -1;
    strcpy(addr.sun_path, sock_path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* "<digits>M" or "<digits>G" (the real daemon takes these two units). */
static int valid_limit(const char *v) {
    size_t n = strlen(v);
    if (n < 2 || (v[n - 1] != 'M' && v[n - 1] != 'G')) return 0;
    for (size_t i = 0; i + 1 < n; i++)
        if (v[i] < '0' || v[i] > '9') return 0;
    return 1;
}

/* Runs one command; writes the answer to `out`. Returns 1 when the daemon is to quit. */
static int command(char *line, FILE *out) {
    char *save = NULL, *cmd = strtok_r(line, " \t\r\n", &save);
    char *a = strtok_r(NULL, " \t\r\n", &save), *b = strtok_r(NULL, " \t\r\n", &save);
    if (!cmd) return 0;
    logf_("CMD %s%s%s%s%s", cmd, a ? " " : "", a ? a : "", b ? " " : "", b ? b : "");
    if (!strcmp(cmd, "get_default_active_thread_percentage")) {
        fprintf(out, "%.1f\n", thread_pct);
    } else if (!strcmp(cmd, "set_default_active_thread_percentage")) {
        char *end = NULL;
        double v = a ? strtod(a, &end) : -1;
        if (!a || *end || v <= 0 || v > 100) fprintf(out, "Invalid percentage\n");
        else fprintf(out, "%.1f\n", thread_pct = v);
    } else if (!strcmp(cmd, "set_default_device_pinned_mem_limit")) {
        if (!a || !b || !valid_limit(b)) {
            fprintf(out, "Invalid device pinned memory limit\n");
            return 0;
        }
        int i = 0;
        while (i < nlimits && strcmp(limits[i].dev, a)) i++;
        if (i == nlimits && nlimits < MAX_LIMITS) nlimits++;
        if (i < MAX_LIMITS) {
            snprintf(limits[i].dev, sizeof limits[i].dev, "%s", a);
            snprintf(limits[i].value, sizeof limits[i].value, "%s", b);
        }
    } else if (!strcmp(cmd, "get_default_device_pinned_mem_limit")) {
        const char *v = "Not Set";
        for (int i = 0; a && i < nlimits; i++)
            if (!strcmp(limits[i].dev, a)) v = limits[i].value;
        fprintf(out, "%s\n", v);
    } else if (!strcmp(cmd, "get_server_list")) {
        /* no CUDA clients in the simulation, so no servers */
    } else if (!strcmp(cmd, "quit")) {
        return 1;
    } else {
        fprintf(out, "Unrecognized command %s\n", cmd);
    }
    return 0;
}

static void serve(int listener) {
    logf_("Startup pid=%d CUDA_VISIBLE_DEVICES=%s", getpid(),
          getenv("CUDA_VISIBLE_DEVICES") ? getenv("CUDA_VISIBLE_DEVICES") : "(all)");
    for (;;) {
        int c = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0) {
            if (errno == EINTR) continue;
            break;
        }
        FILE *in = fdopen(c, "r+");
        if (!in) {
            close(c);
            continue;
        }
        char line[1024];
        int quit = 0;
        if (fgets(line, sizeof line, in)) quit = command(line, in);
        fflush(in);
        fclose(in);
        if (quit) break;
    }
    unlink(sock_path);
    unlink(pid_path);
    logf_("Shutdown");
}

static int start_daemon(int foreground) {
    mkdir(pipe_dir, 0755);
    mkdir(log_dir, 0755);
    int probe = connect_daemon();
    if (probe >= 0) {
        close(probe);
        fprintf(stderr, "An instance of this daemon is already running\n");
        return 1;
    }
    unlink(sock_path); /* left by a daemon that died */
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(sock_path) >= sizeof addr.sun_path) {
        fprintf(stderr, "pipe directory path too long: %s\n", pipe_dir);
        return 1;
    }
    strcpy(addr.sun_path, sock_path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(fd, 64) != 0) {
        fprintf(stderr, "cannot listen on %s: %s\n", sock_path, strerror(errno));
        return 1;
    }
    chmod(sock_path, 0666);
    signal(SIGPIPE, SIG_IGN);
    pid_t pid = foreground ? getpid() : fork();
    if (pid < 0) return 1;
    if (pid > 0 || foreground) { /* the pid file is there before -d returns */
        FILE *f = fopen(pid_path, "w");
        if (f) {
            fprintf(f, "%d\n", (int)pid);
            fclose(f);
        }
        if (!foreground) return 0;
    }
    if (!foreground) {
        setsid();
        int null = open("/dev/null", O_RDWR);
        if (null >= 0) {
            dup2(null, 0);
            dup2(null, 1);
            dup2(null, 2);
            if (null > 2) close(null);
        }
        if (chdir("/") != 0) return 1;
    }
    serve(fd);
    return 0;
}

static int client(void) {
    char line[1024];
    int rc = 0;
    while (fgets(line, sizeof line, stdin)) {
        if (strspn(line, " \t\r\n") == strlen(line)) continue;
        int fd = connect_daemon();
        if (fd < 0) {
            printf("Cannot find MPS control daemon process\n");
            return 1;
        }
        size_t n = strlen(line);
        if (line[n - 1] != '\n') line[n++] = '\n', line[n] = 0;
        if (write(fd, line, n) != (ssize_t)n) rc = 1;
        char buf[4096];
        ssize_t got;
        while ((got = read(fd, buf, sizeof buf)) > 0) fwrite(buf, 1, (size_t)got, stdout);
        close(fd);
    }
    return rc;
}

int main(int argc, char **argv) {
    dirs();
    if (argc > 1 && (!strcmp(argv[1], "-d") || !strcmp(argv[1], "-f"))) return start_daemon(argv[1][1] == 'f');
    if (argc > 1) {
        fprintf(stderr, "usage: nvidia-cuda-mps-control [-d | -f]\n");
        return 1;
    }
    return client();
}
