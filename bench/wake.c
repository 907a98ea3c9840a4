/*
 * bench/wake.c -- the round trip of a 4 KiB write at queue depth 1 over a
 * Unix socket, with the server's thread asleep in recv(2) (how nbdkit's
 * threads wait), in epoll_wait(2) (how an event loop, rawdisk's, waits) or
 * in poll(2) on the one socket, then recv.
 * No NBD: a 4,128-byte message, a 4 KiB pwrite into a memfd, a 16-byte
 * reply. It shows what the way a thread sleeps costs, apart from any
 * server (docs/benchmarks.md, Latency).
 *
 * Usage: cc -O2 -o wake bench/wake.c && ./wake recv|epoll|poll [COUNT]
 * Prints microseconds per round trip over the last 90 % of COUNT (20000),
 * and the server's CPU time (user + system) per round trip over all.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { MSG = 4128, REPLY = 16, SPAN = 1000 };

static double now_us(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void die(const char *what) {
	perror(what);
	exit(1);
}

enum { IN_RECV = -1, IN_POLL = -2 };

/* Receives exactly `len` bytes; with an epoll fd `ep`, sleeps in epoll_wait,
 * with IN_POLL in poll (the socket is non-blocking), instead of in recv.
 * Returns 0 at end of file. */
static int recv_all(int s, char *buf, size_t len, int ep) {
	size_t got = 0;
	while (got < len) {
		if (ep == IN_POLL) {
			struct pollfd p = { .fd = s, .events = POLLIN };
			if (poll(&p, 1, -1) < 0)
				die("poll");
		} else if (ep >= 0) {
			struct epoll_event e;
			if (epoll_wait(ep, &e, 1, -1) < 0)
				die("epoll_wait");
		}
		ssize_t r = recv(s, buf + got, len - got, 0);
		if (r == 0)
			return 0;
		if (r < 0 && !(ep != IN_RECV && errno == EAGAIN))
			die("recv");
		if (r > 0)
			got += (size_t)r;
	}
	return 1;
}

static void serve(int s, const char *how) {
	static char buf[MSG];
	int ep = IN_RECV;
	int fd = memfd_create("wake", 0);
	if (fd < 0)
		die("memfd_create");
	if (!strcmp(how, "poll")) {
		ep = IN_POLL;
		if (fcntl(s, F_SETFL, O_NONBLOCK) < 0)
			die("fcntl");
	} else if (!strcmp(how, "epoll")) {
		struct epoll_event ev = { .events = EPOLLIN | EPOLLET, .data.fd = s };
		if ((ep = epoll_create1(0)) < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev) < 0)
			die("epoll");
		if (fcntl(s, F_SETFL, O_NONBLOCK) < 0)
			die("fcntl");
	}
	for (long i = 0; recv_all(s, buf, MSG, ep); i++) {
		if (pwrite(fd, buf + 32, 4096, (i % SPAN) * 4096L) != 4096)
			die("pwrite");
		if (send(s, buf, REPLY, 0) != REPLY)
			die("send");
	}
	exit(0);
}

int main(int argc, char **argv) {
	if (argc < 2 || (strcmp(argv[1], "recv") && strcmp(argv[1], "epoll") && strcmp(argv[1], "poll"))) {
		fprintf(stderr, "usage: %s recv|epoll|poll [COUNT]\n", argv[0]);
		return 2;
	}
	long n = argc > 2 ? atol(argv[2]) : 20000;
	if (n < 10)
		n = 10;
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) < 0)
		die("socketpair");
	pid_t pid = fork();
	if (pid < 0)
		die("fork");
	if (pid == 0) {
		close(sv[0]);
		serve(sv[1], argv[1]);
	}
	close(sv[1]);
	static char buf[MSG];
	memset(buf, 1, sizeof buf);
	double t0 = 0;
	for (long i = 0; i < n; i++) {
		if (i == n / 10)
			t0 = now_us();
		if (send(sv[0], buf, MSG, 0) != MSG)
			die("send");
		if (!recv_all(sv[0], buf, REPLY, IN_RECV))
			die("server gone");
	}
	double rt = (now_us() - t0) / (double)(n - n / 10);
	close(sv[0]);
	struct rusage ru;
	if (wait4(pid, NULL, 0, &ru) < 0)
		die("wait4");
	double cpu = ru.ru_utime.tv_sec * 1e6 + ru.ru_utime.tv_usec + ru.ru_stime.tv_sec * 1e6 +
		     ru.ru_stime.tv_usec;
	printf("%s: %.1f us per round trip, server CPU %.1f us each\n", argv[1], rt, cpu / (double)n);
	return 0;
}
