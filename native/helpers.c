/* Small C helpers for pyggspec's ggml binding.
 *
 * Why C: ggml logs from its worker threads and the RPC entry points live behind
 * ggml_backend_reg_get_proc_address (so a llama-cpp-python built without RPC still
 * links). Doing either through Python callbacks would take the GIL on ggml threads.
 */
#include <stdbool.h>
#include <stdint.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#endif
#include <stdio.h>
#include <string.h>
#include "ggml.h"
#include "ggml-backend.h"

static int g_min_level = GGML_LOG_LEVEL_WARN;
static int g_last_level = GGML_LOG_LEVEL_NONE;
static int g_counts[8];
static char g_last_error[1024];

static void pyggspec_log_callback(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    int effective = (level == GGML_LOG_LEVEL_CONT) ? g_last_level : (int) level;
    if (level != GGML_LOG_LEVEL_CONT) {
        g_last_level = level;
        if (level >= 0 && level < 8) {
            g_counts[level]++;
        }
        if (level == GGML_LOG_LEVEL_ERROR && text) {
            strncpy(g_last_error, text, sizeof(g_last_error) - 1);
            g_last_error[sizeof(g_last_error) - 1] = 0;
        }
    }
    if (effective >= g_min_level && effective != GGML_LOG_LEVEL_NONE && text) {
        fputs(text, stderr);
        fflush(stderr);
    }
}

void pyggspec_log_set_min_level(int level) {
    g_min_level = level;
    ggml_log_set(pyggspec_log_callback, NULL);
}

int pyggspec_log_get_count(int level) {
    return (level >= 0 && level < 8) ? g_counts[level] : 0;
}

const char * pyggspec_log_last_error(void) {
    return g_last_error;
}

typedef ggml_backend_reg_t (*rpc_add_server_fn)(const char * endpoint);
typedef void (*rpc_start_server_fn)(const char * endpoint, const char * cache_dir,
                                    size_t n_threads, size_t n_devices, ggml_backend_dev_t * devices);
typedef void (*set_n_threads_fn)(ggml_backend_t backend, int n_threads);

/* Connect to an rpc-server and register its devices; NULL when RPC is not built in. */
ggml_backend_reg_t pyggspec_rpc_add_server(const char * endpoint) {
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    if (!rpc) {
        return NULL;
    }
    rpc_add_server_fn fn = (rpc_add_server_fn) ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server");
    if (!fn) {
        return NULL;
    }
    ggml_backend_reg_t reg = fn(endpoint);
    if (reg) {
        ggml_backend_register(reg);
    }
    return reg;
}

/* Serve this process's CPU device over RPC; blocks forever. -1 when RPC is not built in. */
int pyggspec_rpc_start_server(const char * endpoint, const char * cache_dir, size_t n_threads) {
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    if (!rpc) {
        return -1;
    }
    rpc_start_server_fn fn = (rpc_start_server_fn) ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_start_server");
    if (!fn) {
        return -1;
    }
    ggml_backend_dev_t cpu = NULL;
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(d) == GGML_BACKEND_DEVICE_TYPE_CPU) {
            cpu = d;
            break;
        }
    }
    if (!cpu) {
        return -2;
    }
    fn(endpoint, cache_dir, n_threads, 1, &cpu);
    return 0;
}

/* Thread count for any backend that exposes it (CPU, BLAS, ...). */
bool pyggspec_backend_set_n_threads(ggml_backend_t backend, int n_threads) {
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : NULL;
    if (!reg) {
        return false;
    }
    set_n_threads_fn fn = (set_n_threads_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
    if (!fn) {
        return false;
    }
    fn(backend, n_threads);
    return true;
}

/* Forget where the compute tensors of a graph context were placed, so that the
 * scheduler allocates them afresh. ggml-alloc treats a tensor whose data is set as
 * already allocated; a cached graph re-allocated after another graph ran would
 * otherwise keep pointers into a compute buffer that may have been freed or reused. */
void pyggspec_ctx_forget_alloc(struct ggml_context * ctx) {
    for (struct ggml_tensor * t = ggml_get_first_tensor(ctx); t != NULL; t = ggml_get_next_tensor(ctx, t)) {
        t->data = NULL;
        t->buffer = NULL;
        t->extra = NULL;
    }
}

/* The same bytes as ``a`` read as another 4-byte element type (f32 <-> i32): a bit-level
 * reinterpretation, which ggml's API has no op for. Sampling noise uses it to take a
 * float's exponent and mantissa apart exactly (pyggspec/sampling/noise.py). */
struct ggml_tensor * pyggspec_view_bits(struct ggml_context * ctx, struct ggml_tensor * a,
                                        enum ggml_type type) {
    if (ggml_type_size(a->type) != 4 || ggml_type_size(type) != 4 || ggml_blck_size(a->type) != 1
            || ggml_blck_size(type) != 1) {
        return NULL;
    }
    /* a VIEW op (src[0] = a), so that graphs order it after a and schedulers follow it */
    struct ggml_tensor * t = ggml_view_4d(ctx, a, a->ne[0], a->ne[1], a->ne[2], a->ne[3],
                                          a->nb[1], a->nb[2], a->nb[3], 0);
    t->type = type;
    return t;
}

struct pyggspec_probe_hit { int node; int kind; ggml_backend_dev_t dev; struct ggml_tensor * tensor; };

/* Probe a graph before ggml's scheduler splits it: the nodes that a device holding their
 * data cannot run. kind 0: a weight lives on a device that lacks the op -- the scheduler
 * runs the node elsewhere (the CPU) and copies the weight, a fallback pyggspec reports;
 * kind 1: the node writes into a tensor pre-allocated on such a device (a cache or state
 * view) -- ggml_backend_sched would GGML_ABORT, so pyggspec raises an error instead.
 * Returns the number of hits (at most cap are written). */
int pyggspec_graph_probe(struct ggml_cgraph * graph, struct pyggspec_probe_hit * out, int cap) {
    int n = 0;
    const int n_nodes = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n_nodes; i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (t->op == GGML_OP_NONE || t->op == GGML_OP_VIEW || t->op == GGML_OP_RESHAPE ||
                t->op == GGML_OP_PERMUTE || t->op == GGML_OP_TRANSPOSE) {
            continue;
        }
        const struct ggml_tensor * base = t->view_src ? t->view_src : t;
        ggml_backend_buffer_t buf = base->buffer;
        int kind = -1;
        ggml_backend_dev_t dev = NULL;
        struct ggml_tensor * culprit = t;
        if (buf != NULL && !ggml_backend_buffer_is_host(buf) &&
                ggml_backend_buffer_get_usage(buf) != GGML_BACKEND_BUFFER_USAGE_COMPUTE) {
            dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(buf));
            if (dev != NULL && !ggml_backend_dev_supports_op(dev, t)) {
                kind = 1;
            }
        } else {
            /* a weight the device cannot address at all (e.g. larger than its storage-buffer
             * range): ggml aborts on the leaf itself, whatever op reads it */
            for (int s = 0; s < GGML_MAX_SRC && kind < 0; s++) {
                const struct ggml_tensor * src = t->src[s];
                if (src == NULL || src->op != GGML_OP_NONE || src->buffer == NULL ||
                        ggml_backend_buffer_is_host(src->buffer)) {
                    continue;
                }
                dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(src->buffer));
                if (dev != NULL && !ggml_backend_dev_supports_op(dev, src)) {
                    kind = 2;
                    culprit = t->src[s];
                }
            }
            for (int s = 0; s < GGML_MAX_SRC && kind < 0; s++) {
                const struct ggml_tensor * src = t->src[s];
                if (src == NULL || src->buffer == NULL || ggml_backend_buffer_is_host(src->buffer) ||
                        ggml_backend_buffer_get_usage(src->buffer) != GGML_BACKEND_BUFFER_USAGE_WEIGHTS) {
                    continue;
                }
                dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(src->buffer));
                if (dev != NULL && !ggml_backend_dev_supports_op(dev, t)) {
                    kind = 0;
                }
            }
        }
        if (kind >= 0) {
            if (n < cap) {
                out[n].node = i;
                out[n].kind = kind;
                out[n].dev = dev;
                out[n].tensor = culprit;
            }
            n++;
        }
    }
    return n;
}

/* memcpy with streaming stores where the target is 16-byte aligned (x86-64: SSE2, every
 * such CPU has it): a state row copied once is not read again soon, and a plain store
 * reads each target line into the cache before writing it -- half again the traffic on a
 * copy bound by memory bandwidth. */
static void pyggspec_copy_stream(char * dst, const char * src, size_t n) {
#if defined(__x86_64__) || defined(_M_X64)
    if (n >= 4096 && ((uintptr_t) dst & 15) == 0) {
        size_t k = n / 64;
        for (size_t i = 0; i < k; i++) {
            const __m128i * s = (const __m128i *) (src + 64 * i);
            __m128i * d = (__m128i *) (dst + 64 * i);
            __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1);
            __m128i c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
            _mm_stream_si128(d, a);
            _mm_stream_si128(d + 1, b);
            _mm_stream_si128(d + 2, c);
            _mm_stream_si128(d + 3, e);
        }
        _mm_sfence();
        memcpy(dst + 64 * k, src + 64 * k, n - 64 * k);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* Copy n byte ranges between tensors' data: range i is size[i] bytes from src[i] at
 * byte offset src_off[i] to dst[i] at dst_off[i] (tensors passed as addresses). Snapshot
 * rollback uses it to move a slot's recurrent state out of the state arena into its own
 * row (every layer of every such slot in one call) before a verify graph that does not
 * read it overwrites the arena. Host buffers are
 * memcpy'd; a device side goes through the backend (tensor set/get, or a device copy on
 * stack views of the ranges). One thread: on the 2-core bench host two threads copied
 * no faster (the copy is bound by memory bandwidth). Returns 0, or -1-i when range i is
 * outside its tensors. */
int pyggspec_copy_ranges(int n, const intptr_t * src, const int64_t * src_off,
                         const intptr_t * dst, const int64_t * dst_off, const int64_t * size) {
    for (int i = 0; i < n; i++) {
        const struct ggml_tensor * s = (const struct ggml_tensor *) src[i];
        struct ggml_tensor * d = (struct ggml_tensor *) dst[i];
        if (s->data == NULL || d->data == NULL || s->buffer == NULL || d->buffer == NULL
                || src_off[i] < 0 || dst_off[i] < 0 || size[i] < 0
                || (size_t) (src_off[i] + size[i]) > ggml_nbytes(s)
                || (size_t) (dst_off[i] + size[i]) > ggml_nbytes(d)) {
            return -1 - i;
        }
    }
    for (int i = 0; i < n; i++) {
        const struct ggml_tensor * s = (const struct ggml_tensor *) src[i];
        struct ggml_tensor * d = (struct ggml_tensor *) dst[i];
        const int64_t so = src_off[i], dof = dst_off[i], k = size[i];
        bool sh = ggml_backend_buffer_is_host(s->buffer);
        bool dh = ggml_backend_buffer_is_host(d->buffer);
        if (sh && dh) {
            pyggspec_copy_stream((char *) d->data + dof, (const char *) s->data + so, k);
        } else if (sh) {
            ggml_backend_tensor_set(d, (const char *) s->data + so, dof, k);
        } else if (dh) {
            ggml_backend_tensor_get(s, (char *) d->data + dof, so, k);
        } else {
            struct ggml_tensor sv = *s, dv = *d;
            sv.type = dv.type = GGML_TYPE_I8;
            sv.data = (char *) s->data + so;
            dv.data = (char *) d->data + dof;
            sv.ne[0] = dv.ne[0] = k;
            sv.nb[0] = dv.nb[0] = 1;
            for (int m = 1; m < GGML_MAX_DIMS; m++) {
                sv.ne[m] = dv.ne[m] = 1;
                sv.nb[m] = dv.nb[m] = k;
            }
            sv.view_src = dv.view_src = NULL;
            ggml_backend_tensor_copy(&sv, &dv);
        }
    }
    return 0;
}
