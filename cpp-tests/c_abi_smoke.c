/*
 * A C (not C++) translation unit: compiled as strict C11 with -Wall -Wextra -Wpedantic
 * -Werror, it proves kvxfer.h is valid C, and it drives a few calls from C so that the
 * C view of the types (int32_t statuses, _Bool, the buffer struct) is exercised.
 */
#include "kvxfer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int c_abi_smoke(char *why, size_t len);

/* The named structs can be forward-declared and used by their tag. */
struct kvxfer_metrics;
static size_t rooms_by_state_entries(const struct kvxfer_metrics *m) {
    return sizeof m->rooms_by_state / sizeof m->rooms_by_state[0];
}

#define FAIL(...)                                                                          \
    do {                                                                                   \
        snprintf(why, len, __VA_ARGS__);                                                   \
        goto out;                                                                          \
    } while (0)

int c_abi_smoke(char *why, size_t len) {
    int rc = 1;
    kvxfer_config *cfg = NULL;
    kvxfer_engine *engine = NULL;
    void *memory = NULL;
    kvxfer_status st;
    kvxfer_room_state state = KVXFER_ROOM_SUCCESS;
    kvxfer_failure_cause cause = KVXFER_CAUSE_INTERNAL;
    bool from_peer = true;
    bool drained = false;
    char addr[64];
    char reason[128];
    size_t n = 0;
    const char *peers[1];
    kvxfer_buffer buf;
    struct kvxfer_metrics metrics;
    size_t metrics_size = 0;

    why[0] = '\0';
    if (strcmp(kvxfer_version(), KVXFER_VERSION) != 0) {
        FAIL("kvxfer_version() is %s, the header says %s", kvxfer_version(), KVXFER_VERSION);
    }
    if (strcmp(kvxfer_status_str(KVXFER_ERR_NOT_FOUND), "KVXFER_ERR_NOT_FOUND") != 0) {
        FAIL("kvxfer_status_str(KVXFER_ERR_NOT_FOUND) is %s",
             kvxfer_status_str(KVXFER_ERR_NOT_FOUND));
    }
    if (strcmp(kvxfer_room_state_str(KVXFER_ROOM_SUCCESS), "KVXFER_ROOM_SUCCESS") != 0 ||
        strcmp(kvxfer_failure_cause_str(KVXFER_CAUSE_ABORTED), "KVXFER_CAUSE_ABORTED") != 0) {
        FAIL("state or cause names: %s, %s", kvxfer_room_state_str(KVXFER_ROOM_SUCCESS),
             kvxfer_failure_cause_str(KVXFER_CAUSE_ABORTED));
    }
    metrics_size = rooms_by_state_entries(&metrics);
    if (metrics_size != KVXFER_ROOM_STATES) {
        FAIL("rooms_by_state has %zu entries, KVXFER_ROOM_STATES is %d", metrics_size,
             KVXFER_ROOM_STATES);
    }
    if ((st = kvxfer_config_new(&cfg)) != KVXFER_OK) {
        FAIL("config_new: %s", kvxfer_status_str(st));
    }
    st = kvxfer_config_set(cfg, "log_levle", "debug");
    if (st != KVXFER_ERR_UNKNOWN_KEY || kvxfer_last_error(NULL, 0) == 0) {
        FAIL("unknown key gave %s", kvxfer_status_str(st));
    }
    if ((st = kvxfer_config_set(cfg, "role", "decode")) != KVXFER_OK) {
        FAIL("config_set role: %s", kvxfer_status_str(st));
    }
    if ((st = kvxfer_engine_new(cfg, &engine)) != KVXFER_OK) {
        FAIL("engine_new: %s", kvxfer_status_str(st));
    }
    kvxfer_config_free(cfg);
    cfg = NULL;
    if ((st = kvxfer_engine_address(engine, addr, sizeof addr, &n)) != KVXFER_OK ||
        n != strlen(addr)) {
        FAIL("engine_address: %s", kvxfer_status_str(st));
    }

    memory = calloc(16, 4096);
    if (memory == NULL) {
        FAIL("out of memory");
    }
    buf.base = memory;
    buf.len = 16 * 4096;
    buf.item_len = 4096;
    if ((st = kvxfer_register_kv(engine, &buf, 1)) != KVXFER_OK) {
        FAIL("register_kv: %s", kvxfer_status_str(st));
    }
    /* The engine's own address: a decode engine never answers a connection, so the
     * room simply waits in BOOTSTRAPPING until it is aborted. */
    peers[0] = addr;
    if ((st = kvxfer_room_create(engine, 7, peers, 1)) != KVXFER_OK) {
        FAIL("room_create: %s", kvxfer_status_str(st));
    }
    if ((st = kvxfer_room_poll(engine, 7, &state)) != KVXFER_OK ||
        state != KVXFER_ROOM_BOOTSTRAPPING) {
        FAIL("room_poll: %s, state %d", kvxfer_status_str(st), (int)state);
    }
    if ((st = kvxfer_room_abort(engine, 7, "from C")) != KVXFER_OK) {
        FAIL("room_abort: %s", kvxfer_status_str(st));
    }
    if ((st = kvxfer_room_poll(engine, 7, &state)) != KVXFER_OK || state != KVXFER_ROOM_FAILED) {
        FAIL("room_poll after abort: %s, state %d", kvxfer_status_str(st), (int)state);
    }
    if ((st = kvxfer_room_failure(engine, 7, reason, sizeof reason, &n)) != KVXFER_OK ||
        strcmp(reason, "room 7 aborted: from C") != 0) {
        FAIL("room_failure: %s, \"%s\"", kvxfer_status_str(st), reason);
    }
    if ((st = kvxfer_room_failure_cause(engine, 7, &cause, &from_peer)) != KVXFER_OK ||
        cause != KVXFER_CAUSE_ABORTED || from_peer) {
        FAIL("room_failure_cause: %s, cause %d", kvxfer_status_str(st), (int)cause);
    }
    if ((st = kvxfer_room_drained(engine, 7, &drained)) != KVXFER_OK || !drained) {
        FAIL("room_drained: %s", kvxfer_status_str(st));
    }
    if ((st = kvxfer_room_clear(engine, 7)) != KVXFER_OK) {
        FAIL("room_clear: %s", kvxfer_status_str(st));
    }
    st = kvxfer_room_poll(engine, 7, &state);
    if (st != KVXFER_ERR_NOT_FOUND) {
        FAIL("poll after clear: %s", kvxfer_status_str(st));
    }
    rc = 0;
out:
    kvxfer_engine_free(engine);
    kvxfer_config_free(cfg);
    free(memory);
    return rc;
}
