/*
 * Open-loop HTTP/1.1 load generator: Poisson arrivals at a fixed rate, each request's
 * latency measured from its *scheduled* send time. The same measurement as
 * bench/clients/openloop.py, at a fraction of its CPU per request: on a machine where the
 * client shares the cores with the server, a Python client's own work (~60-130 us per
 * request on the 2-core VM) is what limits an overload benchmark of a cheap model.
 *
 * One thread, epoll, a pool of keep-alive connections opened before the first arrival,
 * one request in flight per connection; an arrival with no idle connection waits in the
 * client (FIFO) and that wait counts in its latency. The wait for events ends at the next
 * arrival (epoll_pwait2's nanosecond timeout; a timerfd where the kernel lacks it).
 * Responses are read up to their Content-Length (the server under test always sends one);
 * "connection: close" answers reopen the connection.
 *
 *   cc -O2 -o openloop bench/clients/openloop.c -lm
 *   openloop HOST PORT REQUEST_FILE RATE SECONDS SEED CONNS DRAIN_S OUT_JSON
 *
 * REQUEST_FILE holds the whole raw request (head and body), sent as is. OUT_JSON gets:
 * {"elapsed", "lag_p99_ms", "scheduled", "unfinished", "errors", "codes": {status: n},
 *  "latency_ms": [one per 200 answer]}.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define BUF 65536

typedef struct {
    int fd;
    int busy;
    double scheduled;
    size_t sent;      /* bytes of the request written so far */
    char buf[BUF];    /* the response being read */
    size_t have;
} conn_t;

static const char *g_host;
static int g_port;
static char *g_req;
static size_t g_req_len;
static int g_ep;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t rng_state;
static uint64_t splitmix64(void) {
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}
static double uniform01(void) { /* in (0, 1] */
    return ((double)(splitmix64() >> 11) + 1.0) * (1.0 / 9007199254740992.0);
}

static int open_conn(void) {
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)g_port);
    if (inet_pton(AF_INET, g_host, &addr.sin_addr) != 1) return -1;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
        close(fd);
        return -1;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
}

/* a growable array of doubles */
typedef struct {
    double *v;
    size_t n, cap;
} vec_t;
static void vec_push(vec_t *a, double x) {
    if (a->n == a->cap) {
        a->cap = a->cap ? 2 * a->cap : 4096;
        a->v = realloc(a->v, a->cap * sizeof(double));
        if (!a->v) {
            perror("realloc");
            exit(2);
        }
    }
    a->v[a->n++] = x;
}
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static vec_t latencies, lags;
static long codes[600];
static long errors;
static double last_done;
static int *idle_stack;
static int idle_n;
static double *waiting; /* FIFO of scheduled times */
static size_t wait_head, wait_tail;
static long in_flight;

static void watch(conn_t *c, int index, uint32_t events, int op) {
    struct epoll_event ev;
    ev.events = events;
    ev.data.u64 = (uint64_t)index;
    epoll_ctl(g_ep, op, c->fd, &ev);
}

static void send_more(conn_t *c, int index) {
    while (c->sent < g_req_len) {
        ssize_t n = send(c->fd, g_req + c->sent, g_req_len - c->sent, MSG_NOSIGNAL);
        if (n > 0) {
            c->sent += (size_t)n;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            watch(c, index, EPOLLIN | EPOLLOUT, EPOLL_CTL_MOD);
            return;
        }
        return; /* the error shows on the read side */
    }
}

static void start(conn_t *c, int index, double scheduled) {
    c->busy = 1;
    c->scheduled = scheduled;
    c->sent = 0;
    c->have = 0;
    in_flight++;
    vec_push(&lags, now_s() - scheduled);
    send_more(c, index);
}

static void release(conn_t *c, int index) {
    if (wait_head < wait_tail) {
        start(c, index, waiting[wait_head++]);
    } else {
        idle_stack[idle_n++] = index;
    }
}

static void reopen(conn_t *c, int index) {
    epoll_ctl(g_ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->fd = open_conn();
    c->busy = 0;
    c->have = 0;
    if (c->fd < 0) {
        errors++;
        return; /* the pool shrinks by one */
    }
    watch(c, index, EPOLLIN, EPOLL_CTL_ADD);
    release(c, index);
}

static void fail(conn_t *c, int index) {
    if (c->busy) {
        c->busy = 0;
        in_flight--;
        errors++;
    }
    reopen(c, index);
}

/* A complete response in c->buf? Returns its length, 0 if not yet, -1 if malformed. */
static long complete(conn_t *c, int *status, int *closing) {
    char *end = memmem(c->buf, c->have, "\r\n\r\n", 4);
    if (!end) return c->have >= BUF ? -1 : 0;
    size_t head = (size_t)(end - c->buf) + 4;
    if (c->have < 12 || memcmp(c->buf, "HTTP/1.", 7) != 0) return -1;
    *status = atoi(c->buf + 9);
    long length = -1;
    *closing = 0;
    for (char *line = memchr(c->buf, '\n', head); line && line < end; line = memchr(line, '\n', (size_t)(end - line))) {
        line++;
        if (strncasecmp(line, "content-length:", 15) == 0) length = atol(line + 15);
        else if (strncasecmp(line, "connection:", 11) == 0) {
            const char *v = line + 11;
            while (*v == ' ') v++;
            if (strncasecmp(v, "close", 5) == 0) *closing = 1;
        }
    }
    if (length < 0) return -1;
    if (head + (size_t)length > BUF) return -1;
    return c->have >= head + (size_t)length ? (long)(head + (size_t)length) : 0;
}

static void readable(conn_t *c, int index) {
    int ended = 0; /* closed by the server (after its answer, maybe), or reset */
    /* One read per readiness: epoll is level-triggered, so what a short read left behind
     * is reported again (a second read to see EAGAIN would cost a syscall per answer). */
    ssize_t n = recv(c->fd, c->buf + c->have, BUF - c->have, 0);
    if (n > 0) c->have += (size_t)n;
    else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) ended = 1;
    if (!c->busy) {
        if (c->have || ended) fail(c, index); /* bytes nobody asked for, or closed idle */
        return;
    }
    int status = 0, closing = 0;
    long used = complete(c, &status, &closing);
    if (used == 0) {
        if (ended) fail(c, index);
        return;
    }
    if (used < 0) {
        fail(c, index);
        return;
    }
    closing |= ended;
    double t = now_s();
    c->busy = 0;
    in_flight--;
    if (status > 0 && status < 600) codes[status]++;
    if (status == 200) {
        vec_push(&latencies, t - c->scheduled);
        last_done = t;
    }
    c->have = 0;
    if (closing) reopen(c, index);
    else release(c, index);
}

/* epoll_wait with a nanosecond timeout (Linux 5.11, glibc 2.35); -1 with ENOSYS without. */
static int wait_ns(struct epoll_event *events, const struct timespec *timeout) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 35))
    return epoll_pwait2(g_ep, events, 1024, timeout, NULL);
#else
    (void)events;
    (void)timeout;
    errno = ENOSYS;
    return -1;
#endif
}

int main(int argc, char **argv) {
    if (argc != 10) {
        fprintf(stderr, "usage: %s HOST PORT REQUEST_FILE RATE SECONDS SEED CONNS DRAIN_S OUT_JSON\n", argv[0]);
        return 2;
    }
    g_host = argv[1];
    g_port = atoi(argv[2]);
    double rate = atof(argv[4]), seconds = atof(argv[5]), drain = atof(argv[8]);
    rng_state = (uint64_t)atoll(argv[6]) * 0x2545F4914F6CDD1DULL + 1;
    int nconns = atoi(argv[7]);
    FILE *f = fopen(argv[3], "rb");
    if (!f) {
        perror(argv[3]);
        return 2;
    }
    fseek(f, 0, SEEK_END);
    g_req_len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    g_req = malloc(g_req_len);
    if (!g_req || fread(g_req, 1, g_req_len, f) != g_req_len) {
        perror("read request");
        return 2;
    }
    fclose(f);

    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < (rlim_t)nconns + 64) {
        rl.rlim_cur = rl.rlim_max < (rlim_t)nconns + 64 ? rl.rlim_max : (rlim_t)nconns + 64;
        setrlimit(RLIMIT_NOFILE, &rl);
    }

    /* the arrivals, drawn in advance */
    size_t cap = (size_t)(rate * seconds * 1.3) + 64, count = 0;
    double *arrivals = malloc(cap * sizeof(double));
    for (double t = -log(uniform01()) / rate; t < seconds; t += -log(uniform01()) / rate) {
        if (count == cap) {
            cap *= 2;
            arrivals = realloc(arrivals, cap * sizeof(double));
        }
        arrivals[count++] = t;
    }
    waiting = malloc((count + 1) * sizeof(double));
    idle_stack = malloc((size_t)nconns * sizeof(int));
    conn_t *conns = calloc((size_t)nconns, sizeof(conn_t));
    g_ep = epoll_create1(0);
    for (int i = 0; i < nconns; i++) {
        conns[i].fd = open_conn();
        if (conns[i].fd < 0) {
            perror("connect");
            return 1;
        }
        watch(&conns[i], i, EPOLLIN, EPOLL_CTL_ADD);
        idle_stack[idle_n++] = i;
    }
    int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    struct epoll_event tev = {.events = EPOLLIN, .data.u64 = UINT64_MAX};
    epoll_ctl(g_ep, EPOLL_CTL_ADD, tfd, &tev);

    struct epoll_event events[1024];
    int use_pwait2 = 1; /* the wait's own nanosecond timeout: no timer syscalls per arrival */
    double t0 = now_s();
    size_t next = 0;
    double stop_at = 0;
    for (;;) {
        double now = now_s();
        while (next < count && t0 + arrivals[next] <= now) {
            double scheduled = t0 + arrivals[next++];
            if (idle_n > 0) {
                int i = idle_stack[--idle_n];
                start(&conns[i], i, scheduled);
            } else {
                waiting[wait_tail++] = scheduled;
            }
        }
        if (next == count) {
            if (stop_at == 0) stop_at = now + drain;
            if ((in_flight == 0 && wait_head == wait_tail) || now >= stop_at) break;
        }
        /* wake at the next arrival (or, draining, within 5 ms) */
        double wake = next < count ? t0 + arrivals[next] : now + 0.005;
        double delay = wake - now_s();
        if (delay < 1e-6) delay = 1e-6;
        struct timespec ts = {(time_t)delay, (long)((delay - (double)(time_t)delay) * 1e9)};
        int n;
        if (use_pwait2) {
            n = wait_ns(events, &ts);
            if (n < 0 && errno == ENOSYS) use_pwait2 = 0; /* an older kernel: the timerfd */
        }
        if (!use_pwait2) {
            struct itimerspec its = {{0, 0}, ts};
            timerfd_settime(tfd, 0, &its, NULL);
            n = epoll_wait(g_ep, events, 1024, -1);
        }
        for (int k = 0; k < n; k++) {
            uint64_t id = events[k].data.u64;
            if (id == UINT64_MAX) {
                uint64_t expirations;
                ssize_t r = read(tfd, &expirations, sizeof expirations);
                (void)r;
                continue;
            }
            conn_t *c = &conns[id];
            if (c->fd < 0) continue;
            if (events[k].events & EPOLLOUT) {
                if (c->busy && c->sent < g_req_len) send_more(c, (int)id);
                if (c->sent >= g_req_len) watch(c, (int)id, EPOLLIN, EPOLL_CTL_MOD);
            }
            if (events[k].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) readable(c, (int)id);
        }
    }
    double elapsed = (last_done > 0 ? last_done : now_s()) - t0;
    if (elapsed <= 0) elapsed = 1e-9;
    double lag_p99 = 0;
    if (lags.n) {
        qsort(lags.v, lags.n, sizeof(double), cmp_double);
        size_t i = (size_t)(0.99 * (double)(lags.n - 1));
        lag_p99 = lags.v[i] * 1e3;
    }
    FILE *out = fopen(argv[9], "w");
    if (!out) {
        perror(argv[9]);
        return 2;
    }
    fprintf(out, "{\"elapsed\": %.9f, \"lag_p99_ms\": %.6f, \"scheduled\": %zu, \"unfinished\": %ld, "
                 "\"errors\": %ld, \"codes\": {",
            elapsed, lag_p99, count, in_flight + (long)(wait_tail - wait_head), errors);
    int first = 1;
    for (int s = 0; s < 600; s++) {
        if (!codes[s]) continue;
        fprintf(out, "%s\"%d\": %ld", first ? "" : ", ", s, codes[s]);
        first = 0;
    }
    fprintf(out, "}, \"latency_ms\": [");
    for (size_t i = 0; i < latencies.n; i++) fprintf(out, "%s%.4f", i ? ", " : "", latencies.v[i] * 1e3);
    fprintf(out, "]}\n");
    fclose(out);
    return 0;
}
