/*
 * soak_mem.h — what soak.c knows of its own memory: RSS, the C allocator's view, and a
 * per-mapping account of RSS (/proc/self/smaps) that says where growth happened.
 *
 * Included once, by soak.c, after the standard headers (and <malloc.h> on glibc); every function
 * is static. Linux only (/proc); elsewhere the readers return zeros and the account is empty.
 */
#ifndef SOAK_MEM_H
#define SOAK_MEM_H

/* Resident set size of this process in bytes (/proc/self/statm, field 2), 0 if unreadable. */
static uint64_t rss_bytes(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  unsigned long long size = 0, resident = 0;
  if (f == NULL) return 0;
  int n = fscanf(f, "%llu %llu", &size, &resident);
  fclose(f);
  long page = sysconf(_SC_PAGESIZE);
  return n == 2 && page > 0 ? (uint64_t)resident * (uint64_t)page : 0;
}

static double mib(uint64_t bytes) { return (double)bytes / (1024.0 * 1024.0); }

/* What the C allocator says of its memory, where it can (glibc's mallinfo2; else zeros):
 * `in_use`, the bytes it has handed out and not had back (small chunks plus mmapped blocks), and
 * `held`, what its arenas hold from the system, free chunks included. RSS growing while `in_use`
 * stays flat is the allocator keeping freed memory (per-thread arenas, fragmentation), not the
 * program's live memory growing. */
typedef struct {
  uint64_t in_use, held;
} heap_t;

static heap_t heap_bytes(void) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  struct mallinfo2 m = mallinfo2();
  return (heap_t){.in_use = (uint64_t)m.uordblks + (uint64_t)m.hblkhd,
                  .held = (uint64_t)m.arena + (uint64_t)m.hblkhd};
#else
  return (heap_t){0, 0};
#endif
}

/* One mapping of the address space and its resident kilobytes. */
typedef struct {
  unsigned long start, end;
  char perms[5];
  char name[56]; /* the file, [heap], [stack], or empty for anonymous memory */
  uint64_t rss_kb;
} mapping_t;

enum { MAX_MAPPINGS = 4096 };

/* A snapshot of every mapping's RSS. The arrays live in static storage and main touches both
 * snapshots before the RSS baseline (mem_touch), so taking one later adds no resident pages of
 * its own to what it measures. */
typedef struct {
  mapping_t m[MAX_MAPPINGS];
  size_t n;
  bool truncated;
} mem_map_t;

static void mem_touch(mem_map_t *map) { memset(map, 0, sizeof *map); }

/* Read /proc/self/smaps into `map`: each mapping's range, permissions, name and Rss. */
static void mem_snapshot(mem_map_t *map) {
  map->n = 0;
  map->truncated = false;
  FILE *f = fopen("/proc/self/smaps", "r");
  if (f == NULL) return;
  char line[512];
  mapping_t *cur = NULL;
  while (fgets(line, sizeof line, f) != NULL) {
    unsigned long a, b;
    char perms[5];
    int name_at = 0;
    unsigned long long kb;
    if (sscanf(line, "%lx-%lx %4s %*s %*s %*s %n", &a, &b, perms, &name_at) == 3 &&
        name_at > 0) {
      if (map->n == MAX_MAPPINGS) {
        map->truncated = true;
        cur = NULL;
        continue;
      }
      cur = &map->m[map->n++];
      cur->start = a;
      cur->end = b;
      memcpy(cur->perms, perms, sizeof cur->perms);
      const char *name = line + name_at;
      size_t len = strcspn(name, "\n");
      if (len >= sizeof cur->name) name += len - (sizeof cur->name - 1), len = sizeof cur->name - 1;
      memcpy(cur->name, name, len);
      cur->name[len] = '\0';
      cur->rss_kb = 0;
    } else if (cur != NULL && sscanf(line, "Rss: %llu kB", &kb) == 1) {
      cur->rss_kb = kb;
    }
  }
  fclose(f);
}

/* Print where RSS changed between two snapshots, largest changes first (at most `top` lines),
 * matching mappings by start address: `rss change: +KiB start-end perms size name (was, now)`.
 * A mapping only in `after` counts from 0, one only in `before` to 0. */
static void mem_print_changes(const mem_map_t *before, const mem_map_t *after, size_t top) {
  typedef struct {
    const mapping_t *m;
    int64_t was, now;
  } change_t;
  static change_t ch[2 * MAX_MAPPINGS];
  size_t n = 0;
  int64_t total = 0;
  for (size_t i = 0; i < after->n; i++) {
    const mapping_t *m = &after->m[i];
    int64_t was = 0;
    for (size_t j = 0; j < before->n; j++)
      if (before->m[j].start == m->start) {
        was = (int64_t)before->m[j].rss_kb;
        break;
      }
    if ((int64_t)m->rss_kb != was) ch[n++] = (change_t){m, was, (int64_t)m->rss_kb};
  }
  for (size_t j = 0; j < before->n; j++) {
    bool kept = false;
    for (size_t i = 0; i < after->n && !kept; i++) kept = after->m[i].start == before->m[j].start;
    if (!kept && before->m[j].rss_kb != 0)
      ch[n++] = (change_t){&before->m[j], (int64_t)before->m[j].rss_kb, 0};
  }
  for (size_t i = 0; i < n; i++) total += ch[i].now - ch[i].was;
  printf("rss by mapping: %+" PRId64 " KiB over %zu changed mapping(s)%s\n", total, n,
         before->truncated || after->truncated ? " (snapshot truncated)" : "");
  for (size_t k = 0; k < top && k < n; k++) { /* selection of the k-th largest |change| */
    size_t best = k;
    for (size_t i = k + 1; i < n; i++) {
      int64_t di = ch[i].now - ch[i].was, db = ch[best].now - ch[best].was;
      if ((di < 0 ? -di : di) > (db < 0 ? -db : db)) best = i;
    }
    change_t t = ch[k];
    ch[k] = ch[best];
    ch[best] = t;
    const mapping_t *m = ch[k].m;
    printf("rss change: %+" PRId64 " KiB %lx-%lx %s %lu KiB %s (was %" PRId64 ", now %" PRId64
           ")\n",
           ch[k].now - ch[k].was, m->start, m->end, m->perms, (m->end - m->start) / 1024,
           m->name[0] ? m->name : "[anon]", ch[k].was, ch[k].now);
  }
}

#endif
