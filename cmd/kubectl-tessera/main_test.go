package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/cli-runtime/pkg/genericiooptions"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/rest"
	k8stesting "k8s.io/client-go/testing"
)

// kubeconfig writes a kubeconfig with two contexts: "main" (namespace ctx-ns, the current one) and
// "other" (namespace other-ns). Its server is never dialled: tests get a fake clientset.
func kubeconfig(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config")
	cfg := `apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {server: "https://127.0.0.1:1"}
users:
- name: u
  user: {token: t}
contexts:
- name: main
  context: {cluster: c, user: u, namespace: ctx-ns}
- name: other
  context: {cluster: c, user: u, namespace: other-ns}
current-context: main
`
	if err := os.WriteFile(p, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// result is one run of the command line against a fake API.
type result struct {
	out, errOut string
	err         error
	loaded      *rest.Config // the config the client was made from; nil when none was loaded
	api         *fake.Clientset
}

// execute runs kubectl-tessera's command line as kubectl would, against a fake API holding objs.
func execute(t *testing.T, args []string, objs ...runtime.Object) result {
	t.Helper()
	var out, errOut bytes.Buffer
	r := result{api: fakeAPI(objs...)}
	cmd := newCommand(genericiooptions.IOStreams{In: strings.NewReader(""), Out: &out, ErrOut: &errOut}, genericclioptions.NewConfigFlags(true),
		func(c *rest.Config) (kubernetes.Interface, error) { r.loaded = c; return r.api, nil })
	cmd.SetArgs(args)
	r.err = cmd.ExecuteContext(context.Background())
	r.out, r.errOut = out.String(), errOut.String()
	return r
}

// lists returns the namespace and field selector of each list of resource the command made.
func (r result) lists(resource string) []string {
	var got []string
	for _, a := range r.api.Actions() {
		if la, ok := a.(k8stesting.ListAction); ok && a.GetVerb() == "list" && a.GetResource().Resource == resource {
			got = append(got, fmt.Sprintf("ns=%q fields=%q", la.GetNamespace(), la.GetListRestrictions().Fields.String()))
		}
	}
	return got
}

// TestCommandLine: flags are kubectl's (cli-runtime's ConfigFlags, two dashes, -n/--namespace, -A,
// --context, --as, -o), and a bad command, flag, argument count or output format is refused by
// name before the kubeconfig is loaded (here, one that does not parse: loading it would fail).
func TestCommandLine(t *testing.T) {
	good := kubeconfig(t)
	bad := filepath.Join(t.TempDir(), "garbage")
	if err := os.WriteFile(bad, []byte("{not a kubeconfig"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		args []string
		// wantErr is a part of the error; "" for success.
		wantErr string
		// wantPodList is the pods list pending makes (namespace and selector), when it runs.
		wantPodList string
		wantUser    string
	}{
		{name: "unknown command", args: []string{"frobnicate", "--kubeconfig", bad},
			wantErr: `unknown command "frobnicate" for "kubectl tessera"; commands: nodes, pending, version, why`},
		{name: "unknown command after flags", args: []string{"--kubeconfig", bad, "-n", "x", "podz"}, wantErr: `unknown command "podz"`},
		{name: "go-style flag", args: []string{"-context", "prod", "--kubeconfig", bad}, wantErr: "long flags take two dashes: --context"},
		{name: "go-style flag on a command", args: []string{"pending", "-kubeconfig=" + bad}, wantErr: "long flags take two dashes: --kubeconfig"},
		{name: "unknown flag", args: []string{"pending", "--kubeconfig", bad, "--bogus"}, wantErr: "unknown flag: --bogus (see kubectl tessera pending --help)"},
		{name: "-A belongs to pending", args: []string{"nodes", "-A", "--kubeconfig", bad}, wantErr: "unknown shorthand flag: 'A' in -A"},
		{name: "bad output", args: []string{"pending", "-o", "xml", "--kubeconfig", bad}, wantErr: `unknown output format "xml" for -o; use one of: wide, json, yaml`},
		{name: "bad output for nodes", args: []string{"nodes", "--kubeconfig", bad, "-o=jsonpath={.items}"}, wantErr: `unknown output format "jsonpath={.items}"`},
		{name: "bad output for why", args: []string{"why", "p", "--kubeconfig", bad, "--output", "name"}, wantErr: `unknown output format "name"`},
		{name: "pending takes no pod", args: []string{"pending", "p", "--kubeconfig", bad}, wantErr: `unknown command "p" for "kubectl tessera pending"`},
		{name: "why needs a pod", args: []string{"why", "--kubeconfig", bad}, wantErr: "accepts 1 arg(s), received 0"},
		{name: "garbage kubeconfig is reported when loaded", args: []string{"pending", "--kubeconfig", bad}, wantErr: "kubeconfig:"},
		{name: "context namespace", args: []string{"pending", "--kubeconfig", good}, wantPodList: `ns="ctx-ns"`},
		{name: "-n", args: []string{"pending", "--kubeconfig", good, "-n", "team-a"}, wantPodList: `ns="team-a"`},
		{name: "--namespace before the command", args: []string{"--namespace=team-b", "--kubeconfig", good, "pending"}, wantPodList: `ns="team-b"`},
		{name: "--context", args: []string{"pending", "--kubeconfig", good, "--context", "other"}, wantPodList: `ns="other-ns"`},
		{name: "-A", args: []string{"pending", "--kubeconfig", good, "-n", "team-a", "-A"}, wantPodList: `ns=""`},
		{name: "--all-namespaces", args: []string{"pending", "--kubeconfig", good, "--all-namespaces"}, wantPodList: `ns=""`},
		{name: "--as", args: []string{"pending", "--kubeconfig", good, "--as", "alice", "-o", "json"}, wantPodList: `ns="ctx-ns"`, wantUser: "alice"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("KUBECONFIG", bad)
			r := execute(t, c.args)
			if c.wantErr != "" {
				if r.err == nil || !strings.Contains(r.err.Error(), c.wantErr) {
					t.Fatalf("error %v, want one with %q", r.err, c.wantErr)
				}
				if r.loaded != nil && !strings.Contains(c.wantErr, "kubeconfig") {
					t.Errorf("the kubeconfig was loaded and a client made before the error")
				}
				if len(r.api.Actions()) > 0 {
					t.Errorf("the API was called: %v", r.api.Actions())
				}
				return
			}
			if r.err != nil {
				t.Fatalf("%v\n%s", r.err, r.errOut)
			}
			if got := r.lists("pods"); len(got) != 1 || !strings.HasPrefix(got[0], c.wantPodList+" ") {
				t.Errorf("pods lists %v, want one with %s", got, c.wantPodList)
			}
			if c.wantUser != "" && r.loaded.Impersonate.UserName != c.wantUser {
				t.Errorf("impersonating %q, want %q", r.loaded.Impersonate.UserName, c.wantUser)
			}
		})
	}
}

// TestVersionAndHelp: --version and the version command print the version block, --help the
// usage; neither loads a kubeconfig.
func TestVersionAndHelp(t *testing.T) {
	for _, args := range [][]string{{"--version"}, {"version"}} {
		r := execute(t, args)
		if r.err != nil || !strings.HasPrefix(r.out, "kubectl-tessera, version ") || r.loaded != nil {
			t.Errorf("%v: %v, loaded %v\n%s", args, r.err, r.loaded != nil, r.out)
		}
	}
	r := execute(t, []string{"--help"})
	for _, want := range []string{"Usage:", "kubectl tessera [command]", "--context", "-n, --namespace", "--as ", "-o, --output", "nodes", "pending", "why"} {
		if !strings.Contains(r.out, want) {
			t.Errorf("--help lacks %q:\n%s", want, r.out)
		}
	}
	if r.err != nil || r.loaded != nil {
		t.Errorf("--help: %v, loaded %v", r.err, r.loaded != nil)
	}
}
