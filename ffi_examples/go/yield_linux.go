//go:build linux

package libserve

import "syscall"

// canYield: busy-waiting (wait.go) is available.
const canYield = true

// osYield lets another runnable thread use this CPU, if there is one (sched_yield). It is a raw
// system call, unseen by the Go scheduler: the goroutine keeps its P, which is the point of
// spinning rather than blocking.
func osYield() {
	syscall.RawSyscall(syscall.SYS_SCHED_YIELD, 0, 0, 0)
}
