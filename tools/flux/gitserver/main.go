// Command gitserver serves the bare git repositories under -root over git's smart HTTP
// protocol (`git http-backend` as a CGI), on loopback only: the git server Flux's
// source-controller pulls from in the GitOps tests. It prints its base URL on the first line
// of stdout and serves until killed.
package main

import (
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"net/http/cgi"
	"os"
	"os/exec"
)

func main() {
	root := flag.String("root", "", "directory holding the bare repositories (NAME.git)")
	addr := flag.String("addr", "127.0.0.1:0", "loopback address to listen on")
	flag.Parse()
	if *root == "" {
		log.Fatal("gitserver: -root is required")
	}
	host, _, err := net.SplitHostPort(*addr)
	if err != nil || !net.ParseIP(host).IsLoopback() {
		log.Fatalf("gitserver: %q is not a loopback address", *addr)
	}
	git, err := exec.LookPath("git")
	if err != nil {
		log.Fatal("gitserver: git is not on PATH")
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("http://%s\n", ln.Addr())
	os.Stdout.Sync()
	backend := &cgi.Handler{
		Path: git,
		Args: []string{"http-backend"},
		Env:  []string{"GIT_PROJECT_ROOT=" + *root, "GIT_HTTP_EXPORT_ALL=1"},
	}
	log.Fatal(http.Serve(ln, backend))
}
