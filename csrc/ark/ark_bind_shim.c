// ARK bind/connect shim: applies planned source ports to TCP connections opened by native
// code we do not control (NIXL/UCX, Mooncake TCP), loaded with LD_PRELOAD.
//
// On connect() of an IPv4 stream socket to (dst_ip, dst_port), the next port of that
// destination's list is bound first (lists rotate, so several connections to one peer --
// e.g. one per UCX worker thread -- take different ports). A bind(ip, 0) made before
// connect() is deferred to connect() so the port can still be chosen; any other bind is
// passed through. A busy port is skipped; when none is free the connection keeps an
// ephemeral port (counted). Entries come from ARK_SPORT_MAP at load time,
// "10.0.0.1:47001=40001,40002;10.0.0.2:*=40003" ("*" = any destination port), or at run
// time from ark_shim_set("10.0.0.1", 47001, 40001) (callable through ctypes.CDLL(None)).
// ark_shim_exempt("10.0.0.1", 5600) keeps one destination (a control channel) on ephemeral
// ports even where a wildcard entry covers its host. A port carries at most one live
// connection of this process: ports are bound with SO_REUSEADDR (so TIME_WAIT does not
// block them), which would otherwise let two connections to one destination share a port
// and the second connect() fail with EADDRNOTAVAIL.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_ENTRIES 256
#define MAX_PORTS 16
#define MAX_DEFERRED 1024
#define ANY_PORT 0

struct entry {
  uint32_t ip;    // network order
  uint16_t port;  // host order, ANY_PORT = every port
  uint16_t ports[MAX_PORTS];
  int count, next;
};

static struct entry table[MAX_ENTRIES];
static int n_entries;
static int deferred_fd[MAX_DEFERRED];  // 1 + fd of sockets whose bind(ip, 0) was deferred
static uint32_t deferred_ip[MAX_DEFERRED];
static uint16_t live_port[MAX_DEFERRED];  // port the shim bound to each open fd, 0 = none
static unsigned long applied, fallbacks;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int (*real_bind)(int, const struct sockaddr *, socklen_t);
static int (*real_connect)(int, const struct sockaddr *, socklen_t);
static int (*real_close)(int);

static void resolve(void) {
  if (!real_bind) real_bind = dlsym(RTLD_NEXT, "bind");
  if (!real_connect) real_connect = dlsym(RTLD_NEXT, "connect");
  if (!real_close) real_close = dlsym(RTLD_NEXT, "close");
}

static struct entry *find(uint32_t ip, uint16_t port, int create) {
  for (int i = 0; i < n_entries; i++)
    if (table[i].ip == ip && table[i].port == port) return &table[i];
  if (!create || n_entries == MAX_ENTRIES) return NULL;
  struct entry *e = &table[n_entries++];
  memset(e, 0, sizeof(*e));
  e->ip = ip;
  e->port = port;
  return e;
}

// Add sport to the list of (dst_ip, dst_port); returns 0, or -1 for bad input / full table.
int ark_shim_set(const char *dst_ip, int dst_port, int sport) {
  struct in_addr addr;
  if (!dst_ip || inet_pton(AF_INET, dst_ip, &addr) != 1) return -1;
  if (dst_port < 0 || dst_port > 65535 || sport < 1 || sport > 65535) return -1;
  pthread_mutex_lock(&lock);
  struct entry *e = find(addr.s_addr, (uint16_t)dst_port, 1);
  int rc = -1;
  if (e && e->count < MAX_PORTS) {
    e->ports[e->count++] = (uint16_t)sport;
    rc = 0;
  }
  pthread_mutex_unlock(&lock);
  return rc;
}

// Keep (dst_ip, dst_port) on ephemeral ports; returns 0, or -1 for bad input / full table.
int ark_shim_exempt(const char *dst_ip, int dst_port) {
  struct in_addr addr;
  if (!dst_ip || inet_pton(AF_INET, dst_ip, &addr) != 1) return -1;
  if (dst_port < 1 || dst_port > 65535) return -1;
  pthread_mutex_lock(&lock);
  struct entry *e = find(addr.s_addr, (uint16_t)dst_port, 1);
  if (e) e->count = 0;
  pthread_mutex_unlock(&lock);
  return e ? 0 : -1;
}

static int port_live(uint16_t port) {  // called with lock held
  for (int i = 0; i < MAX_DEFERRED; i++)
    if (live_port[i] == port) return 1;
  return 0;
}

void ark_shim_clear(void) {
  pthread_mutex_lock(&lock);
  n_entries = 0;
  pthread_mutex_unlock(&lock);
}

unsigned long ark_shim_applied(void) { return applied; }
unsigned long ark_shim_fallbacks(void) { return fallbacks; }

// "ip:port=p1,p2;ip:*=p3"; malformed items are skipped
static void load_env(void) {
  const char *text = getenv("ARK_SPORT_MAP");
  if (!text) return;
  char *copy = strdup(text), *save = NULL;
  for (char *item = strtok_r(copy, ";", &save); item; item = strtok_r(NULL, ";", &save)) {
    char *eq = strchr(item, '='), *colon = strrchr(item, ':');
    if (!eq || !colon || colon > eq) continue;
    *eq = *colon = '\0';
    int dport = strcmp(colon + 1, "*") == 0 ? ANY_PORT : atoi(colon + 1);
    char *save_ports = NULL;
    for (char *p = strtok_r(eq + 1, ",", &save_ports); p; p = strtok_r(NULL, ",", &save_ports))
      ark_shim_set(item, dport, atoi(p));
  }
  free(copy);
}

__attribute__((constructor)) static void init(void) {
  resolve();
  load_env();
}

static int is_tcp4(int fd) {
  int type = 0;
  socklen_t len = sizeof(type);
  struct sockaddr_storage own;
  socklen_t own_len = sizeof(own);
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) return 0;
  if (getsockname(fd, (struct sockaddr *)&own, &own_len) != 0) return 0;
  return own.ss_family == AF_INET;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
  resolve();
  const struct sockaddr_in *in = (const struct sockaddr_in *)addr;
  if (addr && addr->sa_family == AF_INET && len >= sizeof(*in) && in->sin_port == 0 &&
      fd >= 0 && fd < MAX_DEFERRED && is_tcp4(fd)) {
    pthread_mutex_lock(&lock);
    int any = n_entries > 0;
    if (any) {
      deferred_fd[fd] = fd + 1;
      deferred_ip[fd] = in->sin_addr.s_addr;
    }
    pthread_mutex_unlock(&lock);
    if (any) return 0;  // bound at connect(), once the destination is known
  }
  return real_bind(fd, addr, len);
}

// Next free port of the destination's list bound to fd; 1 if applied, 0 if none applied.
static int apply(int fd, const struct sockaddr_in *dst, uint32_t src_ip, int deferred) {
  pthread_mutex_lock(&lock);
  struct entry *e = find(dst->sin_addr.s_addr, ntohs(dst->sin_port), 0);
  if (!e) e = find(dst->sin_addr.s_addr, ANY_PORT, 0);
  uint16_t ports[MAX_PORTS];
  int count = 0, start = 0;
  if (e && e->count) {
    count = e->count;
    start = e->next;
    e->next = (e->next + 1) % e->count;
    memcpy(ports, e->ports, sizeof(ports));
  }
  pthread_mutex_unlock(&lock);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  for (int i = 0; i < count; i++) {
    uint16_t port = ports[(start + i) % count];
    struct sockaddr_in src = {.sin_family = AF_INET, .sin_addr.s_addr = src_ip};
    src.sin_port = htons(port);
    pthread_mutex_lock(&lock);
    int ok = !port_live(port) && real_bind(fd, (struct sockaddr *)&src, sizeof(src)) == 0;
    if (ok && fd >= 0 && fd < MAX_DEFERRED) live_port[fd] = port;
    pthread_mutex_unlock(&lock);
    if (ok) {
      __atomic_add_fetch(&applied, 1, __ATOMIC_RELAXED);
      return 1;
    }
  }
  if (count) __atomic_add_fetch(&fallbacks, 1, __ATOMIC_RELAXED);
  if (deferred) {  // honour the deferred bind(ip, 0)
    struct sockaddr_in src = {.sin_family = AF_INET, .sin_addr.s_addr = src_ip};
    real_bind(fd, (struct sockaddr *)&src, sizeof(src));
  }
  return 0;
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
  resolve();
  if (addr && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in) && is_tcp4(fd)) {
    int deferred = 0;
    uint32_t src_ip = htonl(INADDR_ANY);
    pthread_mutex_lock(&lock);
    if (fd >= 0 && fd < MAX_DEFERRED && deferred_fd[fd] == fd + 1) {
      deferred = 1;
      src_ip = deferred_ip[fd];
      deferred_fd[fd] = 0;
    }
    pthread_mutex_unlock(&lock);
    struct sockaddr_in own;
    socklen_t own_len = sizeof(own);
    int unbound = getsockname(fd, (struct sockaddr *)&own, &own_len) == 0 && own.sin_port == 0;
    if (deferred || unbound) apply(fd, (const struct sockaddr_in *)addr, src_ip, deferred);
  }
  return real_connect(fd, addr, len);
}

// a deferred bind must not outlive its socket: the fd number is reused
int close(int fd) {
  resolve();
  if (fd >= 0 && fd < MAX_DEFERRED) {
    pthread_mutex_lock(&lock);
    deferred_fd[fd] = 0;
    live_port[fd] = 0;
    pthread_mutex_unlock(&lock);
  }
  return real_close(fd);
}
