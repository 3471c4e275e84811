/*
 * LD_PRELOAD shim for Mooncake's binaries: a bind() to the wildcard address (0.0.0.0 or ::) binds
 * PREFIXCACHE_BIND_ADDRESS (an IPv4 or IPv6 literal) instead.
 *
 * Mooncake binds several listeners to the wildcard whatever it is told (cachestore/tiers/bind_shim.py lists
 * them), and its transfer protocol has no authentication: anyone who reaches the transfer port reads
 * and writes the segment. Unset variable: bind() is untouched. A wildcard bind that cannot be moved
 * (an IPv6 address asked of an IPv4 socket, an unparsable address) fails with EADDRNOTAVAIL rather
 * than listening everywhere. An IPv4 address asked of an IPv6 socket becomes its mapped form
 * (::ffff:a.b.c.d), which a dual-stack socket accepts IPv4 connections on.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int refuse(void) {
    errno = EADDRNOTAVAIL;
    return -1;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *wanted = getenv("PREFIXCACHE_BIND_ADDRESS");
    if (!wanted || !*wanted || !addr) return real_bind(fd, addr, len);

    struct in_addr v4;
    struct in6_addr v6;
    int is_v4 = inet_pton(AF_INET, wanted, &v4) == 1;
    int is_v6 = !is_v4 && inet_pton(AF_INET6, wanted, &v6) == 1;

    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in moved;
        memcpy(&moved, addr, sizeof moved);
        if (moved.sin_addr.s_addr != htonl(INADDR_ANY)) return real_bind(fd, addr, len);
        if (!is_v4) return refuse();
        moved.sin_addr = v4;
        return real_bind(fd, (const struct sockaddr *)&moved, sizeof moved);
    }
    if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 moved;
        memcpy(&moved, addr, sizeof moved);
        if (!IN6_IS_ADDR_UNSPECIFIED(&moved.sin6_addr)) return real_bind(fd, addr, len);
        if (is_v6) {
            moved.sin6_addr = v6;
        } else if (is_v4) {
            memset(&moved.sin6_addr, 0, sizeof moved.sin6_addr);
            moved.sin6_addr.s6_addr[10] = 0xff;
            moved.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&moved.sin6_addr.s6_addr[12], &v4, sizeof v4);
        } else {
            return refuse();
        }
        return real_bind(fd, (const struct sockaddr *)&moved, sizeof moved);
    }
    return real_bind(fd, addr, len);
}
