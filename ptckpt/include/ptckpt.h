/*
 * ptckpt.h - application control for a program checkpointed by ptckpt, without preload
 * and without linking anything: ptckpt reads and writes the global `ptckpt_app` from
 * outside, finding it by its ELF symbol (do not strip the executable).
 *
 *   #include <ptckpt.h>        cc -I"$(python3 -c 'import ptckpt.app as a; print(a.include_dir())')"
 *
 *   ptckpt_critical_enter("flush");   ... not frozen in here: a dump waits ...
 *   ptckpt_critical_leave();
 *   switch (ptckpt_checkpoint()) {    under `ptckpt run`: checkpoint me now
 *   case PTCKPT_CONTINUED: ...        the dump is done, this is the original process
 *   case PTCKPT_RESTORED: ...         this is a restart of that checkpoint
 *   case PTCKPT_NO_SUPERVISOR: ...    not under `ptckpt run`
 *   }
 *   ptckpt_hold_resume();             after a restore only this thread runs ...
 *   ptckpt_ready();                   ... until here (the other threads stay stopped)
 *
 * The layout is the one ptckpt/app.py documents (the same block in Python programs).
 * The definition is weak, so every file of a program may include this header.
 */
#ifndef PTCKPT_H
#define PTCKPT_H

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

#define PTCKPT_CONTINUED 1
#define PTCKPT_RESTORED 2
#define PTCKPT_FAILED 3               /* the checkpoint asked for could not be taken */
#define PTCKPT_NO_SUPERVISOR (-1)

struct ptckpt_app {
	char magic[8];                    /* "PTCKAPP1" */
	volatile int critical;            /* depth of critical sections */
	volatile int request;             /* 1: checkpoint me (ptckpt run clears it) */
	volatile int state;               /* PTCKPT_CONTINUED / PTCKPT_RESTORED (ptckpt writes) */
	volatile int hold_tid;            /* runs alone after a restore until cleared */
	volatile unsigned long long generation; /* +1 at every dump and restore (ptckpt writes; 8 bytes at +24 with -m32 too) */
	char section[64];                 /* outermost critical section's name */
	char last_image[168];             /* last checkpoint's directory (ptckpt writes) */
};

__attribute__((weak, used)) struct ptckpt_app ptckpt_app = { .magic = "PTCKAPP1" };

static inline void ptckpt_critical_enter(const char *name)
{
	if (ptckpt_app.critical == 0 && name) {
		strncpy(ptckpt_app.section, name, sizeof ptckpt_app.section - 1);
		ptckpt_app.section[sizeof ptckpt_app.section - 1] = 0;
	}
	__atomic_add_fetch(&ptckpt_app.critical, 1, __ATOMIC_SEQ_CST);
}

static inline void ptckpt_critical_leave(void)
{
	if (ptckpt_app.critical > 0)
		__atomic_sub_fetch(&ptckpt_app.critical, 1, __ATOMIC_SEQ_CST);
}

static inline int ptckpt_checkpoint(void)
{
	if (!getenv("PTCKPT_CONTROL"))
		return PTCKPT_NO_SUPERVISOR;
	unsigned long long before = ptckpt_app.generation;
	struct timespec ms = { 0, 1000000 };
	__atomic_store_n(&ptckpt_app.request, 1, __ATOMIC_SEQ_CST);
	while (ptckpt_app.generation == before)
		nanosleep(&ms, NULL);          /* EINTR is fine: we loop */
	return ptckpt_app.state;
}

static inline void ptckpt_hold_resume(void)
{
	ptckpt_app.hold_tid = (int)syscall(SYS_gettid);
}

static inline void ptckpt_ready(void)
{
	__atomic_store_n(&ptckpt_app.hold_tid, 0, __ATOMIC_SEQ_CST);
}

#endif
