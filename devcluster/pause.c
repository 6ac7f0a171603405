/* The pod sandbox process of the real-node cluster (k8s.gcr.io/pause:3.2 there; no registry to pull
   it from). It is PID 1 of every pod: it must reap orphaned children, stop on SIGTERM/SIGINT with
   status 0, and otherwise sleep. Built statically (devcluster/images.py): the image has no libc. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
  (void)sig;
  _exit(0);
}

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, 0, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction stop = {0}, child = {0};
  stop.sa_handler = on_stop;
  child.sa_handler = on_child;
  child.sa_flags = SA_NOCLDSTOP | SA_RESTART;
  sigaction(SIGTERM, &stop, 0);
  sigaction(SIGINT, &stop, 0);
  sigaction(SIGCHLD, &child, 0);
  for (;;) {
    pause();
  }
}
