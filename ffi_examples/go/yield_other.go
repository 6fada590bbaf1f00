//go:build !linux

package libserve

// Without sched_yield through a raw system call, Submit never busy-waits (wait.go): spinning on
// runtime.Gosched would itself wake idle threads.
const canYield = false

func osYield() {}
